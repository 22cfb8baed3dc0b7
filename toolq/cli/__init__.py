"""Every `toolq` command: parsing, rendering, exit codes. The top layer: it may import any other."""
