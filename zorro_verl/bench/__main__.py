"""``python -m zorro_verl.bench``: see :mod:`zorro_verl.bench.cli`."""

import sys

from zorro_verl.bench.cli import main

sys.exit(main())
