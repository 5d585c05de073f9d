#!/usr/bin/python3
# Independent NumPy GGUF reader/writer, F32/F16/BF16/Q8_0/Q4_0 (de)quantization, from the GGUF spec; tests only.
"""Test-only GGUF support, independent of nflash's C++ code.

Written from the GGUF format specification (ggml/docs/gguf.md) and the ggml block layouts:
  header : magic "GGUF", u32 version (2 or 3), u64 tensor_count, u64 kv_count
  kv     : string key, u32 value type, value
  string : u64 byte length, UTF-8 bytes (no terminator)
  array  : u32 element type, u64 count, elements
  tensor : string name, u32 n_dims, u64 dims[n_dims] (dims[0] is the contiguous row length), u32 ggml type,
           u64 offset relative to the start of the data section
  data   : starts at the end of the tensor infos rounded up to general.alignment (default 32)
Block types: Q8_0 = 32 values as {fp16 d, int8 q[32]}, x = d*q.
             Q4_0 = 32 values as {fp16 d, u8 qs[16]}; byte j: low nibble is element j, high nibble element j+16;
                    x = d*(nibble - 8).
Arrays are returned numpy-style: GGUF dims {cols, rows} -> numpy shape (rows, cols).

The writer exists so tests can make GGUF files without nflash's writer; the quantizers follow ggml's reference
(deterministic) quantizers, so bytes can be compared with nflash's quantizer.

Read only (dequantized, never written): Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K, gathered value by value from
where ggml's block structs put each value's quant, scale and min (a formulation unlike ggml's loops).

Usage as a script: gguf_numpy.py FILE  (prints metadata and the tensor table);
                   gguf_numpy.py --dequantize TYPE_ID RAW.bin OUT.npy  (raw blocks -> float32 .npy).
"""

import struct
import sys

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # GGUF spec default when general.alignment is absent

# GGUF metadata value types (spec order).
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, T_UINT64, T_INT64, \
    T_FLOAT64 = range(13)
_SCALAR_FMT = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I", T_INT32: "<i",
               T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d"}
_SCALAR_NP = {T_UINT8: "<u1", T_INT8: "<i1", T_UINT16: "<u2", T_INT16: "<i2", T_UINT32: "<u4", T_INT32: "<i4",
              T_FLOAT32: "<f4", T_BOOL: "<u1", T_UINT64: "<u8", T_INT64: "<i8", T_FLOAT64: "<f8"}

# ggml tensor types supported here: id -> (values per block, bytes per block).
F32, F16, Q4_0, Q8_0, BF16 = 0, 1, 2, 8, 30
# Read (dequantized) only: the legacy Q4_1, Q5_0, Q5_1 and the K-quants (256-value super-blocks).
Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 3, 6, 7, 10, 11, 12, 13, 14
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q8_0: "Q8_0", BF16: "BF16", Q4_1: "Q4_1", Q5_0: "Q5_0",
              Q5_1: "Q5_1", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (32, 34), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22),
         Q5_1: (32, 24), Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}


class GGUFError(Exception):
    pass


def row_bytes(ggml_type, n):
    """Bytes of one row of n values of ggml_type (n must be a multiple of the block size)."""
    per, size = BLOCK[ggml_type]
    if n % per:
        raise GGUFError("row of %d values is not a multiple of the %s block (%d)" % (n, TYPE_NAMES[ggml_type], per))
    return n // per * size


# ----------------------------------------------------------------------------------------------------- dequantization

def dequantize(raw, ggml_type, n):
    """raw: uint8 array holding n values of ggml_type; returns float32 [n]."""
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if ggml_type == F32:
        return raw[:4 * n].view("<f4").astype(np.float32)
    if ggml_type == F16:
        return raw[:2 * n].view("<f2").astype(np.float32)
    if ggml_type == BF16:
        # bf16 is the upper half of an IEEE float32.
        return (raw[:2 * n].view("<u2").astype(np.uint32) << 16).view(np.float32)
    if ggml_type == Q8_0:
        blocks = raw[:n // 32 * 34].reshape(-1, 34)
        d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [nb, 1]
        q = blocks[:, 2:].view(np.int8).astype(np.float32)      # [nb, 32]
        return (d * q).reshape(-1)
    if ggml_type == Q4_0:
        blocks = raw[:n // 32 * 18].reshape(-1, 18)
        d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [nb, 1]
        qs = blocks[:, 2:]                                       # [nb, 16]
        lo = (qs & 0x0F).astype(np.int8) - 8                     # elements 0..15
        hi = (qs >> 4).astype(np.int8) - 8                       # elements 16..31
        q = np.concatenate([lo, hi], axis=1).astype(np.float32)  # [nb, 32]
        return (d * q).reshape(-1)
    if ggml_type in (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K):
        per, size = BLOCK[ggml_type]
        return _dequantize_other(raw[:n // per * size].reshape(-1, size), ggml_type).reshape(-1)
    raise GGUFError("unsupported ggml type %d" % ggml_type)


def _f16(blocks, at):
    """The fp16 field at byte `at` of each block, as float32 [nb, 1]."""
    return blocks[:, at:at + 2].copy().view("<f2").astype(np.float32)


def _scale_min_k4(packed):
    """Q4_K/Q5_K: 12 packed bytes per block -> 8 six-bit scales and 8 six-bit mins, each [nb, 8]."""
    q = packed.astype(np.int32)
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0x0F) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=1)
    return sc, mn


def _dequantize_other(b, t):
    """Blocks b [nb, type size] of a read-only type -> float32 [nb, values per block], by element index: value e's
    quant, scale and min are gathered from where the ggml block layout puts them."""
    nb = b.shape[0]
    if t in (Q4_1, Q5_0, Q5_1):
        d = _f16(b, 0)
        m = _f16(b, 2) if t != Q5_0 else np.zeros((nb, 1), np.float32)
        qs = b[:, {Q4_1: 4, Q5_0: 6, Q5_1: 8}[t]:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)  # values 0..15, then 16..31
        if t != Q4_1:
            at = 2 if t == Q5_0 else 4
            qh = b[:, at:at + 4].copy().view("<u4").astype(np.int64)        # [nb, 1]: bit e is value e's fifth bit
            q = q | (((qh >> np.arange(32)) & 1) << 4).astype(np.int32)
        if t == Q5_0:
            q = q - 16
        return d * q.astype(np.float32) + m
    e = np.arange(256)
    half, w = e // 128, e % 128          # 128-value halves of the super-block
    g, l = w // 32, w % 32               # group of 32 within the half, position in it
    if t == Q2_K:
        scales, qs, d, dmin = b[:, 0:16].astype(np.int32), b[:, 16:80].astype(np.int32), _f16(b, 80), _f16(b, 82)
        q = (qs[:, half * 32 + l] >> (2 * g)) & 3
        s = scales[:, e // 16]
        return d * (s & 0x0F).astype(np.float32) * q.astype(np.float32) - dmin * (s >> 4).astype(np.float32)
    if t == Q3_K:
        hm, qs, d = b[:, 0:32].astype(np.int32), b[:, 32:96].astype(np.int32), _f16(b, 108)
        # the 12 scale bytes as three little-endian u32 words, unpacked word-wise as ggml does
        a = b[:, 96:108].copy().view("<u4").astype(np.uint32)
        k1, k2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
        tmp = a[:, 2]
        words = np.stack([(a[:, 0] & k2) | ((tmp & k1) << np.uint32(4)),
                          (a[:, 1] & k2) | (((tmp >> np.uint32(2)) & k1) << np.uint32(4)),
                          ((a[:, 0] >> np.uint32(4)) & k2) | (((tmp >> np.uint32(4)) & k1) << np.uint32(4)),
                          ((a[:, 1] >> np.uint32(4)) & k2) | (((tmp >> np.uint32(6)) & k1) << np.uint32(4))], axis=1)
        sc = words.astype("<u4").view(np.int8).reshape(nb, 16).astype(np.int32) - 32
        q = (qs[:, half * 32 + l] >> (2 * g)) & 3
        high = (hm[:, l] >> (half * 4 + g)) & 1                              # set: no -4
        return d * sc[:, e // 16].astype(np.float32) * (q - 4 * (1 - high)).astype(np.float32)
    if t in (Q4_K, Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _scale_min_k4(b[:, 4:16])
        qs = b[:, 48:176] if t == Q5_K else b[:, 16:144]
        sub = e // 32                                                        # sub-block 0..7
        byte = qs[:, (sub // 2) * 32 + e % 32].astype(np.int32)
        q = np.where(sub % 2 == 1, byte >> 4, byte & 0x0F)
        if t == Q5_K:
            q = q + 16 * ((b[:, 16:48][:, e % 32].astype(np.int32) >> sub) & 1)
        return d * sc[:, sub].astype(np.float32) * q.astype(np.float32) - dmin * mn[:, sub].astype(np.float32)
    if t == Q6_K:
        ql, qh, d = b[:, 0:128].astype(np.int32), b[:, 128:192].astype(np.int32), _f16(b, 208)
        sc = b[:, 192:208].view(np.int8).astype(np.int32)
        lo_byte = ql[:, half * 64 + l + 32 * (g % 2)]
        nib = np.where(g >= 2, lo_byte >> 4, lo_byte & 0x0F)
        q = (nib | (((qh[:, half * 32 + l] >> (2 * g)) & 3) << 4)) - 32
        return d * sc[:, half * 8 + l // 16 + 2 * g].astype(np.float32) * q.astype(np.float32)
    raise GGUFError("unsupported ggml type %d" % t)


# ------------------------------------------------------------------------------------------------------- quantization

def _fp32_to_fp16_bytes(d):
    return np.asarray(d, dtype=np.float32).astype("<f2").view(np.uint8).reshape(-1, 2)


def quantize(values, ggml_type):
    """float values (any shape, size a multiple of the block) -> uint8 bytes of ggml_type (ggml reference rules)."""
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if ggml_type == F32:
        return x.astype("<f4").view(np.uint8)
    if ggml_type == F16:
        return x.astype("<f2").view(np.uint8)
    if ggml_type == BF16:
        # round to nearest even on the dropped 16 bits (NaN kept quiet), as ggml's fp32->bf16.
        u = x.view(np.uint32).astype(np.uint64)
        nan = np.isnan(x)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        r[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
        return r.astype("<u2").view(np.uint8)
    if len(x) % 32:
        raise GGUFError("%d values is not a multiple of 32" % len(x))
    b = x.reshape(-1, 32)
    if ggml_type == Q8_0:
        amax = np.max(np.abs(b), axis=1)
        d = (amax / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore"):
            idv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = b * idv[:, None]
        q = np.trunc(v + np.copysign(np.float32(0.5), v)).astype(np.int8)  # roundf: half away from zero
        out = np.empty((len(b), 34), dtype=np.uint8)
        out[:, :2] = _fp32_to_fp16_bytes(d)
        out[:, 2:] = q.view(np.uint8)
        return out.reshape(-1)
    if ggml_type == Q4_0:
        idx = np.argmax(np.abs(b), axis=1)  # first index of the largest magnitude, as the strict '<' scan
        mx = b[np.arange(len(b)), idx]
        d = (mx / np.float32(-8)).astype(np.float32)
        with np.errstate(divide="ignore"):
            idv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        v = (b * idv[:, None]).astype(np.float32) + np.float32(8.5)
        q = np.minimum(15, np.trunc(v).astype(np.int32)).astype(np.uint8)  # (int8_t) cast truncates toward zero
        out = np.empty((len(b), 18), dtype=np.uint8)
        out[:, :2] = _fp32_to_fp16_bytes(d)
        out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
        return out.reshape(-1)
    raise GGUFError("unsupported ggml type %d" % ggml_type)


# ------------------------------------------------------------------------------------------------------------- reader

class TensorInfo:
    def __init__(self, name, dims, ggml_type, offset):
        self.name = name
        self.dims = list(dims)          # GGUF order: dims[0] is the row length
        self.type = ggml_type
        self.offset = offset            # relative to the data section
        self.n_elements = int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1
        self.shape = tuple(reversed(self.dims))  # numpy order
        if ggml_type not in BLOCK:
            self.nbytes = None
        elif self.n_elements == 0:
            self.nbytes = 0             # an empty tensor (a zero dimension) is legal and holds no bytes
        else:
            self.nbytes = row_bytes(ggml_type, self.dims[0]) * (self.n_elements // self.dims[0])

    def __repr__(self):
        return "TensorInfo(%s, dims=%s, %s, offset=%d)" % (self.name, self.dims, TYPE_NAMES.get(self.type, self.type),
                                                         self.offset)


class GGUFReader:
    """Reads a GGUF v2/v3 file. Not thread-safe (tests use it from one thread)."""

    def __init__(self, path):
        self.path = path
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.pos = 0
        if bytes(self.mm[:4]) != GGUF_MAGIC:
            raise GGUFError("%s: bad magic %r at offset 0, expected b'GGUF'" % (path, bytes(self.mm[:4])))
        self.pos = 4
        self.version = self._scalar(T_UINT32)
        if self.version not in (2, 3):
            raise GGUFError("%s: version %d at offset 4, expected 2 or 3" % (path, self.version))
        n_tensors = self._scalar(T_UINT64)
        n_kv = self._scalar(T_UINT64)
        self.metadata = {}
        self.metadata_types = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._scalar(T_UINT32)
            self.metadata[key] = self._value(vtype)
            self.metadata_types[key] = vtype
        self.tensors = {}
        self.tensor_order = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(T_UINT32)
            dims = [self._scalar(T_UINT64) for _ in range(n_dims)]
            ggml_type = self._scalar(T_UINT32)
            offset = self._scalar(T_UINT64)
            if name in self.tensors:
                raise GGUFError("%s: duplicate tensor %s" % (path, name))
            self.tensors[name] = TensorInfo(name, dims, ggml_type, offset)
            self.tensor_order.append(name)
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_offset = (self.pos + self.alignment - 1) // self.alignment * self.alignment
        for t in self.tensors.values():
            if t.type not in BLOCK:
                continue  # listed, but not loadable here
            end = self.data_offset + t.offset + t.nbytes
            if end > len(self.mm):
                raise GGUFError("%s: tensor %s ends at %d, past the file size %d" % (path, t.name, end, len(self.mm)))

    # -- header parsing
    def _need(self, n):
        if self.pos + n > len(self.mm):
            raise GGUFError("%s: truncated at offset %d (need %d bytes)" % (self.path, self.pos, n))

    def _scalar(self, vtype):
        fmt = _SCALAR_FMT[vtype]
        n = struct.calcsize(fmt)
        self._need(n)
        (v,) = struct.unpack_from(fmt, self.mm, self.pos)
        self.pos += n
        return v

    def _string(self):
        n = self._scalar(T_UINT64)
        self._need(n)
        s = bytes(self.mm[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def _value(self, vtype):
        if vtype == T_STRING:
            return self._string()
        if vtype == T_ARRAY:
            etype = self._scalar(T_UINT32)
            count = self._scalar(T_UINT64)
            if etype in _SCALAR_NP:  # vectorised: vocab scores/types arrays are large
                size = np.dtype(_SCALAR_NP[etype]).itemsize * count
                self._need(size)
                arr = np.frombuffer(self.mm, dtype=_SCALAR_NP[etype], count=count, offset=self.pos).copy()
                self.pos += size
                return [bool(v) for v in arr] if etype == T_BOOL else arr.tolist()
            return [self._value(etype) for _ in range(count)]
        if vtype not in _SCALAR_FMT:
            raise GGUFError("%s: unknown value type %d before offset %d" % (self.path, vtype, self.pos))
        return self._scalar(vtype)

    # -- tensors
    def raw(self, name):
        t = self.tensors[name]
        start = self.data_offset + t.offset
        return self.mm[start:start + t.nbytes]

    def tensor(self, name, dtype=np.float32):
        """Whole tensor dequantized, numpy shape (reversed GGUF dims)."""
        t = self.tensors[name]
        return dequantize(self.raw(name), t.type, t.n_elements).reshape(t.shape).astype(dtype, copy=False)

    def rows(self, name, start, stop, dtype=np.float32):
        """Rows [start, stop) of a tensor viewed as [n_rows, dims[0]] (all leading axes flattened)."""
        t = self.tensors[name]
        rb = row_bytes(t.type, t.dims[0])
        base = self.data_offset + t.offset
        raw = self.mm[base + start * rb: base + stop * rb]
        return dequantize(raw, t.type, (stop - start) * t.dims[0]).reshape(stop - start, t.dims[0]).astype(
            dtype, copy=False)

    def n_rows(self, name):
        t = self.tensors[name]
        return t.n_elements // t.dims[0]


# ------------------------------------------------------------------------------------------------------------- writer

def _pack_string(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _infer_type(v):
    if isinstance(v, bool):
        return T_BOOL
    if isinstance(v, int):
        return T_INT32 if -2**31 <= v < 2**31 else T_INT64
    if isinstance(v, float):
        return T_FLOAT32
    if isinstance(v, str):
        return T_STRING
    if isinstance(v, (list, tuple)):
        return T_ARRAY
    raise GGUFError("cannot infer a GGUF type for %r" % (v,))


def _pack_value(vtype, v, etype=None):
    if vtype == T_STRING:
        return _pack_string(v)
    if vtype == T_ARRAY:
        if etype is None:
            etype = _infer_type(v[0]) if len(v) else T_INT32
        out = [struct.pack("<IQ", etype, len(v))]
        out += [_pack_value(etype, e) for e in v]
        return b"".join(out)
    return struct.pack(_SCALAR_FMT[vtype], v)


def write_gguf(path, metadata, tensors, alignment=DEFAULT_ALIGNMENT, version=3):
    """metadata: list of (key, value) or (key, value, gguf_type) or (key, list, T_ARRAY, element_type).
    tensors: list of (name, numpy float array in numpy order, ggml_type), or (name, raw uint8 bytes already encoded in
    ggml_type, ggml_type, numpy shape). Writes a GGUF file."""
    kv = []
    for item in metadata:
        key, value = item[0], item[1]
        vtype = item[2] if len(item) > 2 else _infer_type(value)
        etype = item[3] if len(item) > 3 else None
        kv.append(struct.pack("<Q", len(key.encode())) + key.encode() + struct.pack("<I", vtype) +
                  _pack_value(vtype, value, etype))
    if alignment != DEFAULT_ALIGNMENT and not any(item[0] == "general.alignment" for item in metadata):
        kv.append(_pack_string("general.alignment") + struct.pack("<I", T_UINT32) + struct.pack("<I", alignment))
    infos, blobs, offset = [], [], 0
    for item in tensors:
        name, arr, ggml_type = item[:3]
        if len(item) > 3:  # (name, raw bytes already in ggml_type, ggml_type, numpy shape)
            dims = list(reversed(item[3]))
            data = np.asarray(arr, dtype=np.uint8).tobytes()
            if len(data) != row_bytes(ggml_type, dims[0]) * (int(np.prod(dims)) // dims[0]):
                raise GGUFError("tensor %s: %d raw bytes do not match shape %s" % (name, len(data), item[3]))
        else:
            arr = np.asarray(arr)
            dims = list(reversed(arr.shape))
            row_bytes(ggml_type, dims[0])  # raises when the row length is not a whole number of blocks
            data = quantize(arr, ggml_type).tobytes()
        infos.append(_pack_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) +
                     struct.pack("<IQ", ggml_type, offset))
        pad = (-len(data)) % alignment
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    header = GGUF_MAGIC + struct.pack("<IQQ", version, len(tensors), len(kv)) + b"".join(kv) + b"".join(infos)
    header += b"\0" * ((-len(header)) % alignment)
    with open(path, "wb") as f:
        f.write(header)
        for b in blobs:
            f.write(b)


def main(argv):
    if len(argv) == 5 and argv[1] == "--dequantize":
        # --dequantize TYPE_ID RAW.bin OUT.npy: the raw blocks of RAW.bin dequantized, float32, np.save'd
        t = int(argv[2])
        raw = np.fromfile(argv[3], dtype=np.uint8)
        per, size = BLOCK[t]
        np.save(argv[4], dequantize(raw, t, len(raw) // size * per).astype(np.float32))
        return 0
    if len(argv) != 2:
        print("usage: gguf_numpy.py FILE.gguf | --dequantize TYPE_ID RAW.bin OUT.npy", file=sys.stderr)
        return 2
    r = GGUFReader(argv[1])
    print("version %d, %d kv, %d tensors, alignment %d, data at %d" % (r.version, len(r.metadata), len(r.tensors),
                                                                       r.alignment, r.data_offset))
    for k, v in r.metadata.items():
        s = repr(v)
        if isinstance(v, list):
            s = "[%d items] %s" % (len(v), repr(v[:5])[:100])
        print("  %s = %s" % (k, s[:160]))
    for name in r.tensor_order:
        print("  %r" % r.tensors[name])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
