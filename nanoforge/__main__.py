"""`python -m nanoforge` (and `torchrun -m nanoforge`) run the same command as `nanoforge`."""
import sys

from nanoforge.cli import main

sys.exit(main())
