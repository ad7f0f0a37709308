"""Sans-IO Raft log-matching rules that replace pysyncobj's (Raft paper section 5.3).

Stock pysyncobj 0.3.17 (a) sets a follower's nextIndex back to ``ack + 1`` on every successful reply, so
entries already in flight are resent with an older ``prevLogIdx``, and (b) on such a message truncates
everything after ``prevLogIdx`` - matching, even applied, entries - before re-adding the batch. An entry
acknowledged by a majority can then exist on one node only. These functions implement the correct rules;
:mod:`.compat` applies their decisions to pysyncobj's state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Entry = tuple[bytes, int, int]  # (command, index, term), pysyncobj's journal shape


class SafetyViolation(RuntimeError):
    """The leader asked to overwrite a committed entry: the cluster's logs diverged. Fail-stop."""


@dataclass(frozen=True)
class AppendDecision:
    """What a follower does with one AppendEntries message.

    ``truncate_from``: first log index to delete (a real term conflict), or None. ``append``: entries to
    add after truncation. ``reply_next_index``: the ``next_node_idx`` to reply with. ``commit_index``: the
    follower's new commit index (never lower than before).
    """

    success: bool
    truncate_from: int | None
    append: tuple[Entry, ...]
    reply_next_index: int
    commit_index: int


def decide_append(term_at: Callable[[int], int | None], first_index: int, last_index: int,
                  prev_index: int, prev_term: int, entries: Sequence[Entry], leader_commit: int,
                  commit_index: int) -> AppendDecision:
    """Apply the AppendEntries receiver rules to a follower log spanning ``first_index..last_index``.

    ``term_at(i)`` gives the term of local entry ``i`` (None outside the log); ``entries`` must be
    consecutive from ``prev_index + 1``; ``commit_index`` must cover everything already applied.

    - ``prev_index`` outside the log: failure, reply ``last_index + 1`` (the leader resets to it).
    - term mismatch at ``prev_index``: failure, reply ``prev_index`` (the leader steps back).
    - otherwise entries already present with the same term are kept, the first conflicting one and
      all after it are truncated, the rest appended; commit = max(commit, min(leader_commit, index of
      the last new entry)); reply the index after the last new entry.

    Raises:
        SafetyViolation: a conflict at or below ``commit_index``.
        ValueError: ``entries`` not consecutive from ``prev_index + 1``.
    """
    if prev_index < first_index or prev_index > last_index:
        return AppendDecision(False, None, (), last_index + 1, commit_index)
    if term_at(prev_index) != prev_term:
        return AppendDecision(False, None, (), prev_index, commit_index)
    truncate_from: int | None = None
    append: tuple[Entry, ...] = ()
    for position, entry in enumerate(entries):
        index = entry[1]
        if index != prev_index + 1 + position:
            raise ValueError(f"entry index {index} is not consecutive after {prev_index}")
        if index > last_index:
            append = tuple(entries[position:])
            break
        if term_at(index) != entry[2]:
            if index <= commit_index:
                raise SafetyViolation(
                    f"leader conflicts with committed entry {index} (commit index {commit_index})")
            truncate_from = index
            append = tuple(entries[position:])
            break
    last_new = prev_index + len(entries)
    new_commit = max(commit_index, min(leader_commit, last_new))
    return AppendDecision(True, truncate_from, append, last_new + 1, new_commit)


def next_after_reply(next_index: int, match_index: int, success: bool, reset: bool,
                     reply_next_index: int) -> tuple[int, int]:
    """The leader's ``(nextIndex, matchIndex)`` for a follower after one ``next_node_idx`` reply.

    On success matchIndex and nextIndex only grow (a late reply never moves nextIndex back over entries
    already sent). On a reset (log mismatch) nextIndex moves to the follower's hint; matchIndex stays.
    """
    if success:
        return max(next_index, reply_next_index), max(match_index, reply_next_index - 1)
    if reset:
        return max(1, reply_next_index), match_index
    return next_index, match_index
