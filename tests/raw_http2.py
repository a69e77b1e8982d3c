"""A bare HTTP/2 client that puts arbitrary bytes into gRPC metadata.

grpc's own clients refuse to send a metadata value that is not printable ASCII (a NUL, CR LF,
0xff), so tests that check what a server does with such bytes write the frames themselves: the
connection preface, SETTINGS, one HEADERS block (split into CONTINUATION frames when long) whose
fields are HPACK literals "without indexing" and without Huffman coding, so that every byte goes on
the wire as given, then the request message as one DATA frame. The response's grpc-status is read
from its header blocks; gRPC core sends new names and non-binary values as plain literals, which
the small decoder below reads (an indexed or Huffman-coded field is skipped, not decoded).
"""
from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
CANCEL = 0x8  # RST_STREAM's error code
MAX_FRAME_BYTES = 16_384  # SETTINGS_MAX_FRAME_SIZE's initial value
STREAM_ID = 1


def _integer(value: int, prefix_bits: int, first_byte_flags: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 section 5.1) with a prefix_bits-bit prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first_byte_flags | value])
    out, value = bytearray([first_byte_flags | limit]), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal field without indexing, with a new name, neither string Huffman-coded."""
    return b"\x00" + _integer(len(name), 7) + name + _integer(len(value), 7) + value


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


def header_frames(block: bytes, end_stream: bool = False) -> bytes:
    """HEADERS, then CONTINUATION frames, each at most MAX_FRAME_BYTES."""
    chunks = [block[i:i + MAX_FRAME_BYTES] for i in range(0, len(block), MAX_FRAME_BYTES)] or [b""]
    frames = []
    for index, chunk in enumerate(chunks):
        flags = END_HEADERS if index == len(chunks) - 1 else 0
        if index == 0:
            frames.append(_frame(HEADERS, flags | (END_STREAM if end_stream else 0), STREAM_ID, chunk))
        else:
            frames.append(_frame(CONTINUATION, flags, STREAM_ID, chunk))
    return b"".join(frames)


def _read_integer(data: bytes, at: int, prefix_bits: int) -> tuple[int, int]:
    limit = (1 << prefix_bits) - 1
    value, at = data[at] & limit, at + 1
    if value < limit:
        return value, at
    shift = 0
    while True:
        byte, at = data[at], at + 1
        value += (byte & 127) << shift
        shift += 7
        if byte < 128:
            return value, at


def _read_string(data: bytes, at: int) -> tuple[bytes | None, int]:
    """The string at `at` (None when Huffman-coded) and the offset after it."""
    huffman = data[at] & 0x80
    length, at = _read_integer(data, at, 7)
    return (None if huffman else data[at:at + length]), at + length


def literal_fields(block: bytes) -> dict[bytes, bytes]:
    """The fields of a header block that are literals with a new, plain name and a plain value."""
    fields: dict[bytes, bytes] = {}
    at = 0
    while at < len(block):
        first = block[at]
        if first & 0x80:  # indexed field
            _, at = _read_integer(block, at, 7)
            continue
        if first & 0xE0 == 0x20:  # dynamic table size update
            _, at = _read_integer(block, at, 5)
            continue
        name_index, at = _read_integer(block, at, 6 if first & 0x40 else 4)
        name = None
        if name_index == 0:
            name, at = _read_string(block, at)
        value, at = _read_string(block, at)
        if name is not None and value is not None:
            fields[name] = value
    return fields


@dataclass
class RawResponse:
    """What came back on the stream: its grpc-status (None if the server never sent one), whether
    it was reset (RST_STREAM) or the connection went away (GOAWAY, or closed)."""

    grpc_status: int | None = None
    grpc_message: bytes = b""
    reset: bool = False
    goaway: bool = False
    num_data_frames: int = 0
    frame_kinds: list[int] = field(default_factory=list)


def grpc_message_frame(message: bytes) -> bytes:
    """A DATA frame holding one uncompressed gRPC message, ending the stream."""
    return _frame(DATA, END_STREAM, STREAM_ID, b"\x00" + struct.pack(">I", len(message)) + message)


def _connect(host: str, port: int, tls_ca: bytes | None) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=10)
    if tls_ca is None:
        return sock
    context = ssl.create_default_context(cadata=tls_ca.decode())
    context.set_alpn_protocols(["h2"])
    return context.wrap_socket(sock, server_hostname=host)


class Connection:
    """One HTTP/2 connection (TLS when tls_ca is given) carrying one call on stream 1."""

    def __init__(self, host: str, port: int, *, tls_ca: bytes | None = None, timeout: float = 10.0) -> None:
        self.host, self.port, self.tls_ca, self.timeout = host, port, tls_ca, timeout
        self.sock = _connect(host, port, tls_ca)
        self.sock.sendall(PREFACE + _frame(SETTINGS, 0, 0))
        self._reader = _FrameReader(self.sock)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.sock.close()

    def send_request(self, path: str | bytes, metadata: list[tuple[bytes, bytes]], message: bytes = b"") -> None:
        """The call's headers, `metadata` (and a bytes path) written byte for byte, then its one request
        message."""
        raw_path = path if isinstance(path, bytes) else path.encode()
        block = b"".join(_literal(name, value) for name, value in [
            (b":method", b"POST"), (b":scheme", b"https" if self.tls_ca else b"http"), (b":path", raw_path),
            (b":authority", f"{self.host}:{self.port}".encode()), (b"content-type", b"application/grpc"),
            (b"te", b"trailers"), *metadata])
        self.sock.sendall(header_frames(block) + grpc_message_frame(message))

    def reset(self) -> None:
        """RST_STREAM with CANCEL, as a client sends when it cancels or its deadline passes."""
        self.sock.sendall(_frame(RST_STREAM, 0, STREAM_ID, struct.pack(">I", CANCEL)))

    def read_until(self, done: Callable[[RawResponse], bool]) -> RawResponse:
        """Reads frames (answering SETTINGS and PING) until done(response), the stream's end, or the
        connection's; raises TimeoutError after `timeout` seconds."""
        response = RawResponse()
        deadline = time.monotonic() + self.timeout
        while not done(response) and response.grpc_status is None and not response.reset and not response.goaway:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no end of the stream within {self.timeout} s")
            self.sock.settimeout(remaining)
            frame = self._reader.next()
            if frame is None:
                response.goaway = True
                break
            self._handle(frame, response)
        return response

    def _handle(self, frame: tuple[int, int, int, bytes], response: RawResponse) -> None:
        kind, flags, stream_id, payload = frame
        response.frame_kinds.append(kind)
        if kind == SETTINGS and not flags & ACK:
            self.sock.sendall(_frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            self.sock.sendall(_frame(PING, ACK, 0, payload))
        elif kind == HEADERS and stream_id == STREAM_ID:
            fields = literal_fields(payload)  # gRPC core's response blocks fit one frame
            if b"grpc-status" in fields:
                response.grpc_status = int(fields[b"grpc-status"])
                response.grpc_message = fields.get(b"grpc-message", b"")
        elif kind == DATA and stream_id == STREAM_ID:
            response.num_data_frames += 1
        elif kind == RST_STREAM and stream_id == STREAM_ID:
            response.reset = True
        elif kind == GOAWAY:
            response.goaway = True


def call(host: str, port: int, path: str | bytes, metadata: list[tuple[bytes, bytes]], message: bytes = b"",
         *, tls_ca: bytes | None = None, timeout: float = 10.0) -> RawResponse:
    """One unary gRPC call on a connection of its own, `metadata` written byte for byte; its response."""
    with Connection(host, port, tls_ca=tls_ca, timeout=timeout) as connection:
        connection.send_request(path, metadata, message)
        return connection.read_until(lambda response: False)


class _FrameReader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _read(self, count: int) -> bytes | None:
        while len(self.buffer) < count:
            chunk = self.sock.recv(65_536)
            if not chunk:
                return None
            self.buffer += chunk
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def next(self) -> tuple[int, int, int, bytes] | None:
        header = self._read(9)
        if header is None:
            return None
        length = int.from_bytes(header[:3], "big")
        payload = self._read(length) if length else b""
        if payload is None:
            return None
        return header[3], header[4], int.from_bytes(header[5:9], "big") & 0x7FFFFFFF, payload
