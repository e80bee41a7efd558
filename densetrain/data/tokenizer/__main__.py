"""``python -m densetrain.data.tokenizer [DEST]``: install the rank files of the named tokenizers
(``make install`` runs it; :func:`densetrain.data.tokenizer.named.main`)."""

import sys

from densetrain.data.tokenizer.named import main

sys.exit(main())
