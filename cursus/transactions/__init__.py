"""Transactions: exactly-once consume-transform-produce (spec "Transaction Coordinator", issue 16).

Modules, one job each:

* :mod:`cursus.transactions.state`: the coordinator's pure state machine (``TxnEntry`` values and the
  transitions INIT_PRODUCER_ID, BEGIN_TXN, TXN_PUBLISH registration, SEND_OFFSETS_TO_TXN, END_TXN).
* :mod:`cursus.transactions.journal`: ``__transaction_state.journal`` (checksummed, length-prefixed,
  fsynced records; torn-tail truncation; compaction). Blocking I/O: call it off the event loop.
* :mod:`cursus.transactions.markers`: control-record (marker) encoding and recognition.
* :mod:`cursus.transactions.index`: the per-partition transaction index (open transactions, hidden
  ranges, last stable offset) and the read_committed filter.
* :mod:`cursus.transactions.coordinator`: the asyncio service that runs the commit order against the
  broker's replicas and the journal.

Never imports :mod:`cursus.broker` except in the coordinator, through a narrow host protocol.
"""
