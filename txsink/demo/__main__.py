"""``python -m txsink.demo job ...``: the entry point of one demo job process."""

import sys

from txsink.demo.job import main

sys.exit(main())
