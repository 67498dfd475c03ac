import sys

from ckptio.tools.cli import main

sys.exit(main())
