"""Small network helpers shared by the server launcher and the tensor-parallel rendezvous."""
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
