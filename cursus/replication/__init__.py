"""The replication pipeline: followers pull stored chunks from partition leaders (:mod:`.follower`,
:mod:`.leader`, :mod:`.isr`), and committed HWMs go through the metadata log (:mod:`.hwm`)."""
