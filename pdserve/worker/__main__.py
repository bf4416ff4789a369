import sys

from pdserve.worker.main import main

sys.exit(main())
