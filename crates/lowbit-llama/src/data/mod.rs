//! Token data: tokenizers, shards on disk, memory-mapped reading, the sample order (being written).
