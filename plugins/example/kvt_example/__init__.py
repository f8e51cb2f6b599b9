"""kvt's example backend: the smallest complete backend, to copy."""
