import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # so spawned peers can import tests' helper modules

# Tests send Ctrl-C (SIGINT) to the kvt processes they start.  A suite started in
# the background by a non-interactive shell (`.ci/run &`, `nohup ... &`) inherits
# SIGINT ignored, and so would those processes (Python leaves an ignored SIGINT
# ignored): handled here, it is back to the default in every process we start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
