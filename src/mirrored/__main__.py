"""`python -m mirrored train` runs the same command line as `mirrored train`."""
import sys

from mirrored.cli import main

sys.exit(main())
