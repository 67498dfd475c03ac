import sys

from ckptio.cli import main

sys.exit(main())
