import sys

from densetrain.cli import main

sys.exit(main())
