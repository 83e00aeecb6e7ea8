"""Which network interface reaches the master, and TCP stores that listen only on the address asked for.

Two facts of real clusters shape this module. First, gloo picks its interface from the
host name unless GLOO_SOCKET_IFNAME says otherwise, and in containers and cloud VMs the
host name often resolves to 127.0.0.1 (or is shared between hosts): the peers then dial
loopback and the job hangs. The interface that reaches the master is the one the kernel
routes to it, so we ask the kernel: connect() a UDP socket to the master (no packet is
sent) and read the local address it chose, then find the interface holding that address.
Second, torch's TCPStore server listens on every interface whatever host it is given;
handed a socket we bound ourselves (``master_listen_fd``) it listens where we bound it.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct

import torch.distributed as dist

_SIOCGIFADDR = 0x8915  # linux/sockios.h: the IPv4 address of an interface
_libuv_takes_fd: bool | None = None  # learnt on the first server (torch < 2.5: no), so torch logs its refusal once


def resolve_ipv4(host: str) -> str:
    """The IPv4 address ``host`` names (a literal address is returned as is). Raises OSError."""
    address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    return str(address)  # AF_INET's sockaddr is (str, int): str() only tells the type checker


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(resolve_ipv4(host)).is_loopback
    except (OSError, ValueError):
        return False


def route_source_addr(master_addr: str) -> str:
    """The local IPv4 address the kernel uses to reach ``master_addr`` (UDP connect: nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((resolve_ipv4(master_addr), 9))  # port 9 (discard); any port does, no datagram leaves
        return s.getsockname()[0]


def _ipv4_of_interface(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_with_addr(addr: str) -> str | None:
    """The name of the interface that holds the IPv4 address ``addr`` (its primary address), or None."""
    for _, name in socket.if_nameindex():
        if _ipv4_of_interface(name) == addr:
            return name
    return None


def pick_gloo_interface(master_addr: str) -> tuple[str, str] | None:
    """(interface name, local address) that reaches ``master_addr``; None when it cannot be told."""
    try:
        local = route_source_addr(master_addr)
    except OSError:
        return None
    name = interface_with_addr(local)
    return (name, local) if name else None


def ensure_gloo_interface(master_addr: str, environ: dict | os._Environ = os.environ) -> str:
    """Set GLOO_SOCKET_IFNAME to the interface that reaches ``master_addr`` unless the user set it.

    Returns one line for the log saying what was chosen, or why nothing was.
    """
    if environ.get("GLOO_SOCKET_IFNAME"):
        return f"gloo uses interface {environ['GLOO_SOCKET_IFNAME']} (GLOO_SOCKET_IFNAME, set by the user)"
    picked = pick_gloo_interface(master_addr)
    if picked is None:
        return (f"could not tell which interface reaches the master {master_addr}; gloo picks one from the host "
                f"name (set GLOO_SOCKET_IFNAME if the ranks cannot connect)")
    name, local = picked
    environ["GLOO_SOCKET_IFNAME"] = name
    return f"gloo uses interface {name} ({local}), the one that reaches the master {master_addr} (GLOO_SOCKET_IFNAME)"


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: the OS picks). Raises OSError naming both."""
    addr = resolve_ipv4(host)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR as torch's own store server does: a port left in TIME_WAIT by the last run is reusable.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(2048)
    except OSError as e:
        s.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port} ({addr}): {e.strerror}") from None
    return s


def serve_store(host: str, port: int, timeout_s: float, world_size: int | None = None) -> dist.TCPStore:
    """A TCPStore server that listens on ``host:port`` only (not on every interface, as TCPStore alone does).

    torch < 2.5's libuv server cannot take a bound socket: there we use the older server, which can.
    The store owns the socket from then on and closes it when it is freed.
    """
    listener = bind_listener(host, port)
    bound_port = listener.getsockname()[1]
    timeout = datetime.timedelta(seconds=timeout_s)
    global _libuv_takes_fd
    try:
        for use_libuv in (True, False) if _libuv_takes_fd is not False else (False,):
            try:
                store = dist.TCPStore(resolve_ipv4(host), bound_port, world_size, True, timeout,
                                      wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=use_libuv)
                _libuv_takes_fd = use_libuv
                break
            except Exception as e:  # RuntimeError/DistError: "libuv ... does not support ... listen fd"
                if not use_libuv or "listen fd" not in str(e):
                    raise
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store closes the descriptor now
    return store


def accepts(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something listens at ``host:port`` (a plain TCP connect, closed at once). A TCPStore client's
    own connect retries a refused port until its timeout and logs each try: ask this first."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False
