from densetrain.cli import entry

entry()
