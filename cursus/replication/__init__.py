"""The replication pipeline: committed HWM (:mod:`cursus.replication.hwm`), follower fetching and the
leader's fetch service."""
