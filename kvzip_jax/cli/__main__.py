"""`python -m kvzip_jax.cli ...`, the same as `kvzip-jax ...`."""

import sys

from kvzip_jax.cli import main

sys.exit(main())
