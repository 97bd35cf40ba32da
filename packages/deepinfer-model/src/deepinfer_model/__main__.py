"""``python -m deepinfer_model``: the ``deepinfer-model`` command line (see ``deepinfer_model.cli``)."""

from deepinfer_model.cli import main

raise SystemExit(main())
