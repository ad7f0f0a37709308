"""The Raft metadata layer: a hardened pysyncobj (see :mod:`.compat`) behind :class:`.node.RaftNode`."""
