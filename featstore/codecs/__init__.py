"""How values are stored: dense value codecs, sparse soft labels and int8, per-token (ragged) outputs,
chunking and statistics (pure)."""

