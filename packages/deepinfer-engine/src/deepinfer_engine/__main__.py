"""`python -m deepinfer_engine` runs the command line (see `deepinfer_engine.cli`)."""

import sys

from deepinfer_engine.cli import main

sys.exit(main())
