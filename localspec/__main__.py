import sys

from localspec.apps.cli import main

sys.exit(main())
