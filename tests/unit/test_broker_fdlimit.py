"""The open-file budget: CREATE is refused before commit when its partitions' files would not fit."""

from __future__ import annotations

import resource

import pytest

from cursus.broker.fdlimit import FDS_PER_NEW_PARTITION, check_partition_headroom, open_fd_count
from cursus.wire.errors import BrokerError


@pytest.fixture
def low_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = open_fd_count() + 100
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_partitions_that_fit_pass_and_others_are_refused_typed(low_limit):
    check_partition_headroom(0, reserve=0)
    check_partition_headroom(10, reserve=20)  # 40 descriptors of ~100 free
    with pytest.raises(BrokerError) as info:
        check_partition_headroom(100 // FDS_PER_NEW_PARTITION + 1, reserve=0)
    err = info.value.error
    assert err.code == "resource_exhausted" and err.retryable
    assert err.fields["limit"] == str(low_limit) or err.fields["limit"] == low_limit
