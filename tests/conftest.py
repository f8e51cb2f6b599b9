import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # so spawned peers can import tests' helper modules
