/* The optional native half of kproxy's codec: the validating skip of arrays of structs, and the
   splitting and joining of a record batch's records for record encryption and masking (below).

   kproxy/protocol/compiler.py turns the schema of one message version into a small program (one row
   of integers per struct, shown by `kproxy decode --show-codec`); skip() walks encoded structs with it
   and rejects exactly what the generated Python decoders reject, so a lazy array validated here can
   be decoded later without failing. Every read is checked against `end` before it happens. Nothing
   here allocates per element except the span records the caller asks for. No I/O. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Must match compiler.py's _OP table; bump ABI when the encoding of a program changes. */
#define ABI 1
enum {
    OP_FIXED = 1,      /* k: k bytes of fixed-width fields */
    OP_CBLOB = 2,      /* nullable: compact string or bytes */
    OP_BLOB = 3,       /* width nullable: classic string (width 2) or bytes (width 4) */
    OP_ARRFIX = 4,     /* compact nullable unit: array of fixed-width values */
    OP_ARRBLOB = 5,    /* compact nullable width: array of strings or bytes (elements never null) */
    OP_ARRSTRUCT = 6,  /* compact nullable sid min_elem record: array of structs */
    OP_STRUCT = 7,     /* sid: a struct */
    OP_NSTRUCT = 8,    /* sid: a nullable struct (int8 marker, negative = null) */
    OP_TAGS = 9,       /* nknown (tag sid)*nknown: the tagged-field section */
};
static const int OP_ARGS[] = {0, 1, 1, 2, 3, 3, 5, 1, 1, -1};

#define MAX_DEPTH 64

typedef struct {
    PyObject_HEAD
    Py_ssize_t nstructs;
    Py_ssize_t *starts; /* nstructs + 1 offsets into ops */
    int64_t *ops;
} ProgramObject;

static void program_dealloc(ProgramObject *self)
{
    PyMem_Free(self->starts);
    PyMem_Free(self->ops);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *program_new(PyTypeObject *type, PyObject *args, PyObject *kwds);

static PyTypeObject ProgramType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kproxy.protocol._accel.Program",
    .tp_doc = "A validating skip program: a tuple with one tuple of ints per struct.",
    .tp_basicsize = sizeof(ProgramObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = program_new,
    .tp_dealloc = (destructor)program_dealloc,
};

/* Checks the whole program once, so the interpreter can trust opcodes, argument counts and struct
   ids. */
static PyObject *program_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *rows;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Program() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!:Program", &PyTuple_Type, &rows))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(rows), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_GET_ITEM(rows, i);
        if (!PyTuple_Check(row)) {
            PyErr_SetString(PyExc_TypeError, "each struct of a program is a tuple of ints");
            return NULL;
        }
        total += PyTuple_GET_SIZE(row);
    }
    ProgramObject *self = (ProgramObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->nstructs = n;
    self->starts = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    self->ops = PyMem_Calloc((size_t)total + 1, sizeof(int64_t));
    if (self->starts == NULL || self->ops == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_GET_ITEM(rows, i);
        self->starts[i] = at;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(row); j++) {
            long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(row, j));
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(self);
                return NULL;
            }
            self->ops[at++] = v;
        }
    }
    self->starts[n] = at;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *op = self->ops + self->starts[i], *stop = self->ops + self->starts[i + 1];
        while (op < stop) {
            int64_t code = op[0];
            Py_ssize_t nargs;
            if (code < OP_FIXED || code > OP_TAGS)
                goto bad;
            nargs = code == OP_TAGS ? (op + 1 < stop ? 1 + 2 * op[1] : -1) : OP_ARGS[code];
            if (nargs < 0 || op + 1 + nargs > stop)
                goto bad;
            if (code == OP_ARRSTRUCT && (op[3] < 0 || op[3] >= n || op[4] < 1))
                goto bad;
            if ((code == OP_STRUCT || code == OP_NSTRUCT) && (op[1] < 0 || op[1] >= n))
                goto bad;
            if (code == OP_TAGS)
                for (int64_t t = 0; t < op[1]; t++)
                    if (op[3 + 2 * t] < 0 || op[3 + 2 * t] >= n)
                        goto bad;
            if ((code == OP_FIXED && op[1] < 0) || (code == OP_ARRFIX && op[3] < 1)
                    || ((code == OP_BLOB || code == OP_ARRBLOB) && op[code == OP_BLOB ? 1 : 3] != 2
                        && op[code == OP_BLOB ? 1 : 3] != 4))
                goto bad;
            op += 1 + nargs;
        }
    }
    return (PyObject *)self;
bad:
    Py_DECREF(self);
    PyErr_SetString(PyExc_ValueError, "malformed skip program");
    return NULL;
}

typedef struct {
    const uint8_t *buf;
    const ProgramObject *prog;
    PyObject *spans; /* dict or NULL */
    Py_ssize_t lazy_min;
} Ctx;

/* Kafka's unsigned varint, at most 5 bytes, as primitives.read_uvarint. */
static inline int read_uv(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, int64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift <= 28; shift += 7) {
        if (*pos >= end)
            return -1;
        uint8_t b = buf[(*pos)++];
        v |= (uint64_t)(b & 0x7f) << shift;
        if (b < 0x80) {
            *out = (int64_t)v;
            return 0;
        }
    }
    return -1;
}

static inline int read_be(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, int width, int64_t *out)
{
    if (end - *pos < width)
        return -1;
    const uint8_t *p = buf + *pos;
    *out = width == 2 ? (int64_t)(int16_t)(((uint16_t)p[0] << 8) | p[1])
                      : (int64_t)(int32_t)(((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16)
                                           | ((uint32_t)p[2] << 8) | p[3]);
    *pos += width;
    return 0;
}

/* A count or length into *n; -1 means null (allowed only when nullable). */
static inline int read_count(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, int compact,
                             int width, int nullable, int64_t *n)
{
    if (compact) {
        if (read_uv(buf, pos, end, n))
            return -1;
        *n -= 1;
    } else if (read_be(buf, pos, end, width, n)) {
        return -1;
    }
    if (*n < -1 || (*n == -1 && !nullable))
        return -1;
    return 0;
}

static Py_ssize_t run(const Ctx *c, int64_t sid, Py_ssize_t pos, Py_ssize_t end, int64_t count,
                      int depth);

static inline int skip_bytes(Py_ssize_t *pos, Py_ssize_t end, int64_t n)
{
    if (n > end - *pos)
        return -1;
    *pos += (Py_ssize_t)n;
    return 0;
}

static Py_ssize_t run(const Ctx *c, int64_t sid, Py_ssize_t pos, Py_ssize_t end, int64_t count,
                      int depth)
{
    if (depth > MAX_DEPTH)
        return -1;
    const int64_t *first = c->prog->ops + c->prog->starts[sid];
    const int64_t *stop = c->prog->ops + c->prog->starts[sid + 1];
    const uint8_t *buf = c->buf;
    int64_t n;
    for (int64_t i = 0; i < count; i++) {
        const int64_t *op = first;
        while (op < stop) {
            switch (op[0]) {
            case OP_FIXED:
                if (skip_bytes(&pos, end, op[1]))
                    return -1;
                op += 2;
                break;
            case OP_CBLOB:
            case OP_BLOB: {
                int compact = op[0] == OP_CBLOB;
                if (read_count(buf, &pos, end, compact, compact ? 0 : (int)op[1],
                               (int)(compact ? op[1] : op[2]), &n))
                    return -1;
                if (n > 0 && skip_bytes(&pos, end, n))
                    return -1;
                op += compact ? 2 : 3;
                break;
            }
            case OP_ARRFIX:
                if (read_count(buf, &pos, end, (int)op[1], 4, (int)op[2], &n))
                    return -1;
                if (n > 0 && (n > (end - pos) / op[3] || skip_bytes(&pos, end, n * op[3])))
                    return -1;
                op += 4;
                break;
            case OP_ARRBLOB: {
                int compact = (int)op[1], width = (int)op[3];
                if (read_count(buf, &pos, end, compact, 4, (int)op[2], &n))
                    return -1;
                if (n > 0 && n > (end - pos) / (compact ? 1 : width))
                    return -1;
                for (int64_t j = 0; j < n; j++) {
                    int64_t len;
                    if (read_count(buf, &pos, end, compact, width, 0, &len))
                        return -1;
                    if (skip_bytes(&pos, end, len))
                        return -1;
                }
                op += 4;
                break;
            }
            case OP_ARRSTRUCT: {
                Py_ssize_t start = pos;
                if (read_count(buf, &pos, end, (int)op[1], 4, (int)op[2], &n))
                    return -1;
                if (n > 0) {
                    if (n > (end - pos) / op[4])
                        return -1;
                    pos = run(c, op[3], pos, end, n, depth + 1);
                    if (pos < 0)
                        return pos;
                    if (op[5] && c->spans != NULL && n >= c->lazy_min) {
                        /* Where this array ends, so decoding its parent later need not walk it. */
                        PyObject *k = PyLong_FromSsize_t(start), *v = PyLong_FromSsize_t(pos);
                        int err = k == NULL || v == NULL || PyDict_SetItem(c->spans, k, v) < 0;
                        Py_XDECREF(k);
                        Py_XDECREF(v);
                        if (err)
                            return -2;
                    }
                }
                op += 6;
                break;
            }
            case OP_STRUCT:
                pos = run(c, op[1], pos, end, 1, depth + 1);
                if (pos < 0)
                    return pos;
                op += 2;
                break;
            case OP_NSTRUCT:
                if (pos >= end)
                    return -1;
                if (buf[pos++] < 128) {
                    pos = run(c, op[1], pos, end, 1, depth + 1);
                    if (pos < 0)
                        return pos;
                }
                op += 2;
                break;
            case OP_TAGS: {
                int64_t nt, nknown = op[1];
                if (read_uv(buf, &pos, end, &nt))
                    return -1;
                if (nt > end - pos)
                    return -1;
                for (int64_t j = 0; j < nt; j++) {
                    int64_t tag, size;
                    if (read_uv(buf, &pos, end, &tag) || read_uv(buf, &pos, end, &size))
                        return -1;
                    if (size > end - pos)
                        return -1;
                    Py_ssize_t tend = pos + (Py_ssize_t)size;
                    for (int64_t t = 0; t < nknown; t++) {
                        if (op[2 + 2 * t] == tag) {
                            /* A known tagged field must fill its declared size exactly. */
                            Py_ssize_t got = run(c, op[3 + 2 * t], pos, tend, 1, depth + 1);
                            if (got != tend)
                                return got == -2 ? -2 : -1;
                            break;
                        }
                    }
                    pos = tend;
                }
                op += 2 + 2 * nknown;
                break;
            }
            default:
                return -1; /* unreachable: program_new checked every opcode */
            }
        }
    }
    return pos;
}

PyDoc_STRVAR(skip_doc,
"skip(program, sid, buf, pos, end, count, spans, lazy_min) -> int\n\n"
"Skip `count` encoded structs `sid` of `program` in `buf[pos:end]`, checking everything the decoder\n"
"checks, and return the position after them; ValueError if the bytes are invalid. Arrays of structs\n"
"marked for it with at least `lazy_min` elements record spans[start] = end in the dict `spans`.");

static PyObject *skip(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "skip() takes 8 arguments");
        return NULL;
    }
    if (!PyObject_TypeCheck(args[0], &ProgramType)) {
        PyErr_SetString(PyExc_TypeError, "skip() needs a Program");
        return NULL;
    }
    const ProgramObject *prog = (const ProgramObject *)args[0];
    Py_ssize_t sid = PyLong_AsSsize_t(args[1]), pos = PyLong_AsSsize_t(args[3]);
    Py_ssize_t end = PyLong_AsSsize_t(args[4]), count = PyLong_AsSsize_t(args[5]);
    Py_ssize_t lazy_min = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (sid < 0 || sid >= prog->nstructs) {
        PyErr_SetString(PyExc_ValueError, "no such struct in the program");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[2], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t got = -1;
    if (0 <= pos && pos <= end && end <= view.len && count >= 0) {
        Ctx c = {view.buf, prog, PyDict_Check(args[6]) ? args[6] : NULL, lazy_min};
        got = run(&c, sid, pos, end, count, 0);
    }
    PyBuffer_Release(&view);
    if (got == -2)
        return NULL;
    if (got < 0) {
        PyErr_SetString(PyExc_ValueError, "invalid encoding");
        return NULL;
    }
    return PyLong_FromSsize_t(got);
}

/* ---- Record batches: a v2 batch's records split into their parts, and joined again ----------------

   Record encryption and masking replace keys and values of every record of a batch; the Python loop of
   kproxy/protocol/records/rewrite.py costs microseconds per record, these the same work in C. Same
   checks and results as the Python functions (a test holds them equal); every read is checked
   against the end of the buffer before it happens. */

/* A zig-zag varint of at most max_bytes at b[*pos]; 0, or -1 past `end`, -2 when too long. */
static int read_zigzag(const unsigned char *b, Py_ssize_t end, Py_ssize_t *pos, int max_bytes, int64_t *out)
{
    uint64_t v = 0;
    int shift = 0;
    for (int i = 0; i < max_bytes; i++) {
        if (*pos >= end)
            return -1;
        unsigned char c = b[(*pos)++];
        v |= (uint64_t)(c & 0x7F) << shift;
        if (c < 0x80) {
            *out = (int64_t)(v >> 1) ^ -(int64_t)(v & 1);
            return 0;
        }
        shift += 7;
    }
    return -2;
}

static PyObject *split_fail(PyObject *reason, Py_ssize_t pos)
{
    if (reason != NULL) {
        PyObject *args = Py_BuildValue("(Nn)", reason, pos);
        if (args != NULL) {
            PyErr_SetObject(PyExc_ValueError, args);
            Py_DECREF(args);
        }
    }
    return NULL;
}

static PyObject *varint_fail(int got, int max_bytes, Py_ssize_t start)
{
    if (got == -1)
        return split_fail(PyUnicode_FromString("record runs past the end of the batch"), start);
    return split_fail(PyUnicode_FromFormat("varint longer than %d bytes", max_bytes), start);
}

PyDoc_STRVAR(split_records_doc,
"split_records(records, count) -> (heads, keys, values, tails)\n\n"
"The `count` records of an uncompressed v2 records section (a memoryview) as four lists of slices of\n"
"it: each record's head (attributes, timestamp and offset deltas), key and value (None when null)\n"
"and tail (its headers). ValueError((reason, position)) when a record does not fit.");

static PyObject *split_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "split_records() takes 2 arguments");
        return NULL;
    }
    PyObject *src = args[0];
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(src, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *b = view.buf;
    Py_ssize_t end = view.len;
    PyObject *lists[4] = {NULL, NULL, NULL, NULL};
    PyObject *result = NULL;
    if (count < 0 || count > end) {
        split_fail(PyUnicode_FromFormat("record count %zd cannot fit in %zd bytes", count, end), 0);
        goto done;
    }
    for (int k = 0; k < 4; k++) {
        lists[k] = PyList_New(count);
        if (lists[k] == NULL)
            goto done;
    }
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t start = pos;
        int64_t length, tmp, n;
        int got = read_zigzag(b, end, &pos, 5, &length);
        if (got < 0) {
            varint_fail(got, 5, start);
            goto done;
        }
        if (length < 5 || length > end - pos) {
            split_fail(PyUnicode_FromFormat("record length %lld outside 6..%zd", (long long)length, end - pos), start);
            goto done;
        }
        Py_ssize_t p = pos, stop = pos + (Py_ssize_t)length, q = pos + 1;     /* attributes */
        if ((got = read_zigzag(b, end, &q, 10, &tmp)) < 0 || (got = read_zigzag(b, end, &q, 5, &tmp)) < 0) {
            varint_fail(got, got == -2 ? 10 : 5, start);
            goto done;
        }
        PyObject *part = PySequence_GetSlice(src, p, q);
        if (part == NULL)
            goto done;
        PyList_SET_ITEM(lists[0], i, part);
        for (int k = 1; k <= 2; k++) {                                        /* key, value */
            if ((got = read_zigzag(b, end, &q, 5, &n)) < 0) {
                varint_fail(got, 5, start);
                goto done;
            }
            if (n < 0) {
                Py_INCREF(Py_None);
                part = Py_None;
            } else if (n > stop - q) {
                split_fail(PyUnicode_FromString(k == 1 ? "key overruns its record" : "value overruns its record"),
                           start);
                goto done;
            } else {
                part = PySequence_GetSlice(src, q, q + (Py_ssize_t)n);
                if (part == NULL)
                    goto done;
                q += (Py_ssize_t)n;
            }
            PyList_SET_ITEM(lists[k], i, part);
        }
        if (q >= stop) {
            split_fail(PyUnicode_FromString("key or value overruns its record"), start);
            goto done;
        }
        part = PySequence_GetSlice(src, q, stop);
        if (part == NULL)
            goto done;
        PyList_SET_ITEM(lists[3], i, part);
        pos = stop;
    }
    if (pos != end) {
        split_fail(PyUnicode_FromFormat("%zd bytes remain after the last of %zd records", end - pos, count), pos);
        goto done;
    }
    result = PyTuple_Pack(4, lists[0], lists[1], lists[2], lists[3]);
done:
    for (int k = 0; k < 4; k++)
        Py_XDECREF(lists[k]);
    PyBuffer_Release(&view);
    return result;
}

static Py_ssize_t zigzag_size(int64_t v)
{
    uint64_t z = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    Py_ssize_t n = 1;
    while (z >= 0x80) {
        z >>= 7;
        n++;
    }
    return n;
}

static unsigned char *write_zigzag(unsigned char *out, int64_t v)
{
    uint64_t z = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    while (z >= 0x80) {
        *out++ = (unsigned char)((z & 0x7F) | 0x80);
        z >>= 7;
    }
    *out++ = (unsigned char)z;
    return out;
}

/* The length of a bytes-like part (-1 for None); -2 with an exception set. */
static Py_ssize_t part_len(PyObject *o)
{
    if (o == Py_None)
        return -1;
    if (PyBytes_CheckExact(o))
        return PyBytes_GET_SIZE(o);
    Py_buffer v;
    if (PyObject_GetBuffer(o, &v, PyBUF_SIMPLE) < 0)
        return -2;
    Py_ssize_t n = v.len;
    PyBuffer_Release(&v);
    return n;
}

static int copy_part(PyObject *o, unsigned char **out)
{
    if (o == Py_None)
        return 0;
    if (PyBytes_CheckExact(o)) {
        memcpy(*out, PyBytes_AS_STRING(o), (size_t)PyBytes_GET_SIZE(o));
        *out += PyBytes_GET_SIZE(o);
        return 0;
    }
    Py_buffer v;
    if (PyObject_GetBuffer(o, &v, PyBUF_SIMPLE) < 0)
        return -1;
    memcpy(*out, v.buf, (size_t)v.len);
    *out += v.len;
    PyBuffer_Release(&v);
    return 0;
}

PyDoc_STRVAR(join_records_doc,
"join_records(heads, keys, values, tails) -> bytes\n\n"
"An uncompressed v2 records section from four equally long lists as split_records gives them (keys\n"
"and values may be None for null): each record's length, head, key, value and tail.");

static PyObject *join_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "join_records() takes 4 arguments");
        return NULL;
    }
    for (int k = 0; k < 4; k++) {
        if (!PyList_Check(args[k])) {
            PyErr_SetString(PyExc_TypeError, "join_records() takes four lists");
            return NULL;
        }
    }
    Py_ssize_t count = PyList_GET_SIZE(args[0]);
    for (int k = 1; k < 4; k++) {
        if (PyList_GET_SIZE(args[k]) != count) {
            PyErr_SetString(PyExc_ValueError, "join_records() needs lists of one length");
            return NULL;
        }
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t len[4];
        for (int k = 0; k < 4; k++) {
            len[k] = part_len(PyList_GET_ITEM(args[k], i));
            if (len[k] == -2 || ((k == 0 || k == 3) && len[k] < 0)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_TypeError, "a record's head and tail are bytes, never None");
                return NULL;
            }
        }
        Py_ssize_t body = len[0] + zigzag_size(len[1]) + (len[1] > 0 ? len[1] : 0) + zigzag_size(len[2])
                          + (len[2] > 0 ? len[2] : 0) + len[3];
        total += zigzag_size(body) + body;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        return NULL;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *head = PyList_GET_ITEM(args[0], i), *key = PyList_GET_ITEM(args[1], i);
        PyObject *value = PyList_GET_ITEM(args[2], i), *tail = PyList_GET_ITEM(args[3], i);
        Py_ssize_t hl = part_len(head), kl = part_len(key), vl = part_len(value), tl = part_len(tail);
        if (hl < 0 || kl == -2 || vl == -2 || tl < 0) {     /* changed between the two passes */
            Py_DECREF(out);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "a record part changed while it was joined");
            return NULL;
        }
        Py_ssize_t body = hl + zigzag_size(kl) + (kl > 0 ? kl : 0) + zigzag_size(vl) + (vl > 0 ? vl : 0) + tl;
        w = write_zigzag(w, body);
        if (copy_part(head, &w) < 0)
            goto fail;
        w = write_zigzag(w, kl);
        if (copy_part(key, &w) < 0)
            goto fail;
        w = write_zigzag(w, vl);
        if (copy_part(value, &w) < 0 || copy_part(tail, &w) < 0)
            goto fail;
    }
    if (w != (unsigned char *)PyBytes_AS_STRING(out) + total) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_RuntimeError, "a record part changed while it was joined");
        return NULL;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"skip", (PyCFunction)(void (*)(void))skip, METH_FASTCALL, skip_doc},
    {"split_records", (PyCFunction)(void (*)(void))split_records, METH_FASTCALL, split_records_doc},
    {"join_records", (PyCFunction)(void (*)(void))join_records, METH_FASTCALL, join_records_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kproxy.protocol._accel",
    .m_doc = "Native validating skip for kproxy's generated codecs (optional; see compiler.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__accel(void)
{
    if (PyType_Ready(&ProgramType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ProgramType);
    if (PyModule_AddObject(m, "Program", (PyObject *)&ProgramType) < 0
            || PyModule_AddIntConstant(m, "ABI", ABI) < 0) {
        Py_DECREF(&ProgramType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
