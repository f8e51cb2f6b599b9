"""kvt's host-staging backend: the default that works on any machine."""
