"""The replication pipeline: followers pull stored chunks from partition leaders (issue 13)."""
