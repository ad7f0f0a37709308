from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FetchRequest(_message.Message):
    __slots__ = ("follower_id", "max_wait_ms", "max_bytes", "partitions")
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    follower_id: str
    max_wait_ms: int
    max_bytes: int
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionFetch]
    def __init__(self, follower_id: _Optional[str] = ..., max_wait_ms: _Optional[int] = ..., max_bytes: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[PartitionFetch, _Mapping]]] = ...) -> None: ...

class PartitionFetch(_message.Message):
    __slots__ = ("topic", "partition", "fetch_offset", "last_fetched_epoch", "leader_epoch", "lifecycle_epoch", "max_bytes")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    FETCH_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_FETCHED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    fetch_offset: int
    last_fetched_epoch: int
    leader_epoch: int
    lifecycle_epoch: int
    max_bytes: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., fetch_offset: _Optional[int] = ..., last_fetched_epoch: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., lifecycle_epoch: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("partitions",)
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    partitions: _containers.RepeatedCompositeFieldContainer[PartitionData]
    def __init__(self, partitions: _Optional[_Iterable[_Union[PartitionData, _Mapping]]] = ...) -> None: ...

class PartitionData(_message.Message):
    __slots__ = ("topic", "partition", "error", "leader_epoch", "hwm", "log_start_offset", "leo", "chunks", "diverging_epoch", "skip_to", "cleaned_gaps")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HWM_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEO_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DIVERGING_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SKIP_TO_FIELD_NUMBER: _ClassVar[int]
    CLEANED_GAPS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    error: Error
    leader_epoch: int
    hwm: int
    log_start_offset: int
    leo: int
    chunks: bytes
    diverging_epoch: DivergingEpoch
    skip_to: int
    cleaned_gaps: bool
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., leader_epoch: _Optional[int] = ..., hwm: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., leo: _Optional[int] = ..., chunks: _Optional[bytes] = ..., diverging_epoch: _Optional[_Union[DivergingEpoch, _Mapping]] = ..., skip_to: _Optional[int] = ..., cleaned_gaps: _Optional[bool] = ...) -> None: ...

class DivergingEpoch(_message.Message):
    __slots__ = ("epoch", "end_offset")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    end_offset: int
    def __init__(self, epoch: _Optional[int] = ..., end_offset: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "fields")
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    fields: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., fields: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("leader_id", "topic", "partition", "leader_epoch", "key", "version", "payload")
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    leader_id: str
    topic: str
    partition: int
    leader_epoch: int
    key: str
    version: int
    payload: str
    def __init__(self, leader_id: _Optional[str] = ..., topic: _Optional[str] = ..., partition: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., key: _Optional[str] = ..., version: _Optional[int] = ..., payload: _Optional[str] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: Error
    def __init__(self, error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class TxnRecordRequest(_message.Message):
    __slots__ = ("coordinator_id", "topic", "partition", "record", "coordinator_epoch", "transactional_id", "producer_id", "producer_epoch", "kind", "timeout_ms")
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSACTIONAL_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    coordinator_id: str
    topic: str
    partition: int
    record: bytes
    coordinator_epoch: int
    transactional_id: str
    producer_id: str
    producer_epoch: int
    kind: str
    timeout_ms: int
    def __init__(self, coordinator_id: _Optional[str] = ..., topic: _Optional[str] = ..., partition: _Optional[int] = ..., record: _Optional[bytes] = ..., coordinator_epoch: _Optional[int] = ..., transactional_id: _Optional[str] = ..., producer_id: _Optional[str] = ..., producer_epoch: _Optional[int] = ..., kind: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class TxnRecordResponse(_message.Message):
    __slots__ = ("error", "end_offset", "duplicate", "records")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    error: Error
    end_offset: int
    duplicate: bool
    records: int
    def __init__(self, error: _Optional[_Union[Error, _Mapping]] = ..., end_offset: _Optional[int] = ..., duplicate: _Optional[bool] = ..., records: _Optional[int] = ...) -> None: ...
