import os
import sys

from paratrain.cli import main

code = main()
if code and os.environ.get("TORCHELASTIC_RUN_ID"):
    # A failed worker leaves its process group open on purpose (its peers must not report
    # a lost connection before it reports the cause). Tearing that group down during
    # interpreter shutdown can abort with "terminate called without an active exception"
    # and turn a clean exit code into SIGABRT, so a failed worker ends here, at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
