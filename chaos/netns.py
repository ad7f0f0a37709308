"""A private network for the cluster harness: the harness in its own network namespace, one namespace per
broker, and partitions as nftables drop rules by address pair.

Layout (everything lives in namespaces the harness created, so the host's own network is never touched)::

    harness namespace (unshare -n -m)            node namespace chaos-n<i> (ip netns add)
      lo up, ip_forward=1                          lo up
      ch<i>  10.77.<i+1>.1/24  <-- veth -->         eth0 10.77.<i+1>.2/24, default route via .1
      nftables: table inet cursus_chaos, chain cuts (hook forward): ``ip saddr A ip daddr B drop``

Why not one shared loopback with 127.0.0.11-13: on a loopback the kernel picks the source address by
destination (``127.0.0.1`` for every 127/8 destination), so a packet from broker A to broker B does not carry
A's address and cannot be dropped by address pair. With one namespace per broker routed through the
harness namespace, every packet between brokers crosses the harness's forward hook with the true source and
destination, so isolations, splits and *one-way* drops are exact. Clients (the harness's workloads) reach
every broker directly on its veth, so partitions cut only broker-to-broker traffic (Raft and replication).

Entry point: :func:`reexec_in_namespace` (called by ``python -m chaos run --nodes N`` with N > 1) re-executes
the harness inside ``unshare -n -m --propagation private`` with :data:`ENV_MARK` set; then
:class:`Network` builds the node namespaces. Everything disappears with the harness's namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence

#: Set in the environment of the re-executed harness (the value is informational).
ENV_MARK = "CURSUS_CHAOS_NETNS"
#: nftables table and chain holding the partition rules.
NFT_TABLE = "cursus_chaos"
NFT_CHAIN = "cuts"


class NetworkUnavailable(RuntimeError):
    """Namespaces or nftables cannot be used here (not root, no ``unshare``/``ip``/``nft``)."""


def missing_tools() -> list[str]:
    """The tools the private network needs that are not on ``PATH``."""
    return [tool for tool in ("unshare", "ip", "nft") if shutil.which(tool) is None]


def inside_namespace() -> bool:
    """True in the re-executed harness."""
    return bool(os.environ.get(ENV_MARK))


def reexec_in_namespace(argv: Sequence[str]) -> None:
    """Replace this process with ``unshare -n -m --propagation private python -m chaos <argv>``.

    Returns only when already inside (then the caller goes on). The pid stays the same (``unshare`` without
    ``--fork`` execs), so signals and process groups reach the harness as before.

    Raises:
        NetworkUnavailable: not root, or a needed tool is missing.
    """
    if inside_namespace():
        return
    if os.geteuid() != 0:
        raise NetworkUnavailable("the cluster harness needs root for network namespaces (unshare -n)")
    missing = missing_tools()
    if missing:
        raise NetworkUnavailable(f"missing tools: {', '.join(missing)} (apt-get install iproute2 nftables util-linux)")
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, ENV_MARK: "1"}
    unshare = shutil.which("unshare")
    assert unshare is not None
    os.execve(unshare, [unshare, "-n", "-m", "--propagation", "private", sys.executable, "-m", "chaos", *argv], env)


def _run(*cmd: str, stdin: str | None = None) -> str:
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=20, check=False)
    if proc.returncode != 0:
        raise NetworkUnavailable(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[:400]}")
    return proc.stdout


def node_address(index: int) -> str:
    """The address broker ``index`` (from 0) binds inside its namespace."""
    return f"10.77.{index + 1}.2"


def namespace_name(index: int) -> str:
    """The ``ip netns`` name of node ``index``."""
    return f"chaos-n{index}"


class Network:
    """The node namespaces and the partition rules (only inside the harness namespace).

    Args:
        nodes: how many broker namespaces.
    """

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        #: The directed pairs ``(src, dst)`` (node indexes) currently dropped.
        self.cuts: frozenset[tuple[int, int]] = frozenset()
        #: Packets dropped per directed pair since the network was built (summed over every cut): the proof
        #: that a partition really dropped traffic (see :meth:`dropped`).
        self.drops: dict[tuple[int, int], int] = {}

    def setup(self) -> None:
        """Create the namespaces, veths, routes and the empty nftables chain.

        Raises:
            NetworkUnavailable: not inside the harness namespace, or a command failed.
        """
        if not inside_namespace():
            raise NetworkUnavailable("Network.setup runs only inside the harness namespace (reexec_in_namespace)")
        _run("ip", "link", "set", "lo", "up")
        os.makedirs("/run/netns", exist_ok=True)
        _run("mount", "-t", "tmpfs", "chaos-netns", "/run/netns")  # private to this mount namespace
        with open("/proc/sys/net/ipv4/ip_forward", "w") as f:  # this namespace's own sysctl
            f.write("1\n")
        for i in range(self.nodes):
            ns, host_if, net = namespace_name(i), f"ch{i}", f"10.77.{i + 1}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "addr", "add", f"{net}.1/24", "dev", host_if)
            _run("ip", "link", "set", host_if, "up")
            for cmd in (("ip", "link", "set", "lo", "up"), ("ip", "addr", "add", f"{net}.2/24", "dev", "eth0"),
                        ("ip", "link", "set", "eth0", "up"), ("ip", "route", "add", "default", "via", f"{net}.1")):
                _run("ip", "netns", "exec", ns, *cmd)
        _run("nft", "-f", "-", stdin=f"table inet {NFT_TABLE} {{\n chain {NFT_CHAIN} {{\n"
                                     "  type filter hook forward priority 0; policy accept;\n }\n}\n")

    def exec_prefix(self, index: int) -> list[str]:
        """The command prefix that runs a program inside node ``index``'s namespace."""
        return ["ip", "netns", "exec", namespace_name(index)]

    def set_cuts(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Replace the dropped directed pairs with ``pairs`` (atomically, one ``nft -f`` transaction).

        Raises:
            NetworkUnavailable: nft failed.
        """
        cuts = frozenset((int(a), int(b)) for a, b in pairs if a != b)
        rules = "".join(f"add rule inet {NFT_TABLE} {NFT_CHAIN} ip saddr {node_address(a)} "
                        f"ip daddr {node_address(b)} counter drop\n" for a, b in sorted(cuts))
        if self.cuts:
            self._collect_counters()
        _run("nft", "-f", "-", stdin=f"flush chain inet {NFT_TABLE} {NFT_CHAIN}\n{rules}")
        self.cuts = cuts
        if cuts:
            installed = set(self._counters())
            if installed != set(cuts):
                raise NetworkUnavailable(f"nft holds drop rules for {sorted(installed)}, expected {sorted(cuts)}")

    def _counters(self) -> dict[tuple[int, int], int]:
        """The packet counter of every drop rule in the chain now, by directed pair."""
        listing = json.loads(_run("nft", "-j", "list", "chain", "inet", NFT_TABLE, NFT_CHAIN))
        return parse_counters(listing, self.nodes)

    def _collect_counters(self) -> None:
        for pair, packets in self._counters().items():
            self.drops[pair] = self.drops.get(pair, 0) + packets

    def dropped(self) -> dict[tuple[int, int], int]:
        """Packets dropped per directed pair so far, the rules in place now included.

        Raises:
            NetworkUnavailable: nft failed.
        """
        current = self._counters() if self.cuts else {}
        return {pair: self.drops.get(pair, 0) + current.get(pair, 0) for pair in set(self.drops) | set(current)}

    def heal(self) -> None:
        """Drop no traffic."""
        self.set_cuts(())


def parse_counters(listing: dict, nodes: int) -> dict[tuple[int, int], int]:
    """``{(src, dst): packets}`` from ``nft -j list chain`` output: the rules that match ``ip saddr`` and
    ``ip daddr`` of two node addresses and carry a ``counter`` (other rules are ignored)."""
    by_address = {node_address(i): i for i in range(nodes)}
    out: dict[tuple[int, int], int] = {}
    for item in listing.get("nftables", []):
        rule = item.get("rule") if isinstance(item, dict) else None
        if not rule:
            continue
        src = dst = None
        packets = None
        for expr in rule.get("expr", []):
            match = expr.get("match") if isinstance(expr, dict) else None
            if match:
                left = (match.get("left") or {}).get("payload") or {}
                if left.get("protocol") == "ip" and left.get("field") == "saddr":
                    src = by_address.get(str(match.get("right")))
                elif left.get("protocol") == "ip" and left.get("field") == "daddr":
                    dst = by_address.get(str(match.get("right")))
            elif isinstance(expr, dict) and "counter" in expr:
                packets = int((expr["counter"] or {}).get("packets", 0))
        if src is not None and dst is not None and packets is not None:
            out[(src, dst)] = out.get((src, dst), 0) + packets
    return out


def isolate(node: int, nodes: int) -> set[tuple[int, int]]:
    """Both directions between ``node`` and every other node."""
    return split({node}, nodes)


def split(side: set[int], nodes: int) -> set[tuple[int, int]]:
    """Both directions between ``side`` and the rest."""
    rest = set(range(nodes)) - side
    return {(a, b) for a in side for b in rest} | {(b, a) for a in side for b in rest}
