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
#include <structmember.h>

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

/* One record's parts, as offsets into the records section (key_len and value_len -1 when null). */
typedef struct {
    Py_ssize_t head, head_end, key, value, tail, stop;
    Py_ssize_t key_len, value_len;
} Rec;

/* The record at *pos, which moves past it; -1 with ValueError((reason, position)) set when it does
   not fit. The same checks and reasons as rewrite.py's _split_records. */
static int parse_record(const unsigned char *b, Py_ssize_t end, Py_ssize_t *pos, Rec *r)
{
    Py_ssize_t start = *pos, p = *pos;
    int64_t length, tmp, n;
    int got = read_zigzag(b, end, &p, 5, &length);
    if (got < 0) {
        varint_fail(got, 5, start);
        return -1;
    }
    if (length < 5 || length > end - p) {
        split_fail(PyUnicode_FromFormat("record length %lld outside 6..%zd", (long long)length, end - p), start);
        return -1;
    }
    Py_ssize_t stop = p + (Py_ssize_t)length, q = p + 1;                     /* attributes */
    if ((got = read_zigzag(b, end, &q, 10, &tmp)) < 0 || (got = read_zigzag(b, end, &q, 5, &tmp)) < 0) {
        varint_fail(got, got == -2 ? 10 : 5, start);
        return -1;
    }
    r->head = p;
    r->head_end = q;
    for (int k = 1; k <= 2; k++) {                                            /* key, value */
        if ((got = read_zigzag(b, end, &q, 5, &n)) < 0) {
            varint_fail(got, 5, start);
            return -1;
        }
        Py_ssize_t at = q, len = -1;
        if (n >= 0) {
            if (n > stop - q) {
                split_fail(PyUnicode_FromString(k == 1 ? "key overruns its record" : "value overruns its record"),
                           start);
                return -1;
            }
            len = (Py_ssize_t)n;
            q += len;
        }
        if (k == 1) {
            r->key = at;
            r->key_len = len;
        } else {
            r->value = at;
            r->value_len = len;
        }
    }
    if (q >= stop) {
        split_fail(PyUnicode_FromString("key or value overruns its record"), start);
        return -1;
    }
    r->tail = q;
    r->stop = stop;
    *pos = stop;
    return 0;
}

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
        Rec r;
        if (parse_record(b, end, &pos, &r) < 0)
            goto done;
        Py_ssize_t from[4] = {r.head, r.key, r.value, r.tail};
        Py_ssize_t to[4] = {r.head_end, r.key + r.key_len, r.value + r.value_len, r.stop};
        for (int k = 0; k < 4; k++) {
            PyObject *part;
            if ((k == 1 && r.key_len < 0) || (k == 2 && r.value_len < 0)) {
                Py_INCREF(Py_None);
                part = Py_None;
            } else {
                part = PySequence_GetSlice(src, from[k], to[k]);
                if (part == NULL)
                    goto done;
            }
            PyList_SET_ITEM(lists[k], i, part);
        }
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

/* Sealing and opening a records section in one pass (kproxy/envelope/records.py, whose Python
   reference does the same work through split and join, and a test holds the two equal byte for
   byte). The envelope's layout is kproxy/envelope/format.py's: header || nonce (12) || ciphertext
   || tag (16); the associated data is header || binding suffix, and for a header with the
   KEY_BOUND flag (byte 6, bit 0) || 00 (null key) or || 01 || the record's plaintext key. The cipher
   is always the caller's `cryptography` AESGCM method (encrypt_into / decrypt_into): nothing here
   encrypts, it only places bytes and calls. */

#define NONCE 12
#define TAG 16
#define FLAG_KEY_BOUND 0x01
static const unsigned char ENVELOPE_MAGIC[4] = {0xFF, 'k', 'p', 'e'};

static int sealed_part(const unsigned char *b, Py_ssize_t at, Py_ssize_t len)
{
    return len >= 4 && memcmp(b + at, ENVELOPE_MAGIC, 4) == 0;
}

/* A window onto bytes the caller owns (the records, the output being written): a buffer the
   cipher reads or writes through, re-pointed from record to record instead of a memoryview made and
   freed for each argument of each call. Only ever handed to the cipher for the length of one call;
   one still held afterwards (exports or references left) is let go and a new one made. */
typedef struct {
    PyObject_HEAD
    char *buf;
    Py_ssize_t len;
    int readonly;
    Py_ssize_t exports;
} WindowObject;

static int window_getbuffer(WindowObject *self, Py_buffer *view, int flags)
{
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->buf, self->len, self->readonly, flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void window_releasebuffer(WindowObject *self, Py_buffer *view)
{
    (void)view;
    self->exports--;
}

static PyBufferProcs window_as_buffer = {
    (getbufferproc)window_getbuffer,
    (releasebufferproc)window_releasebuffer,
};

static PyTypeObject WindowType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kproxy.protocol._accel.Window",
    .tp_doc = "A buffer onto bytes seal_records or open_records is reading or writing (internal).",
    .tp_basicsize = sizeof(WindowObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_as_buffer = &window_as_buffer,
};

/* A window let go: one that something still holds is closed first (empty), so that it never
   reaches bytes that may be gone. */
static char window_empty[1];

static void window_drop(PyObject **slot)
{
    WindowObject *w = (WindowObject *)*slot;
    if (w == NULL)
        return;
    if (Py_REFCNT(w) != 1 && w->exports == 0) {
        w->buf = window_empty;
        w->len = 0;
        w->readonly = 1;
    }
    Py_DECREF(w);
    *slot = NULL;
}

/* *slot pointed at buf[0:len]: the same object when nothing else holds it, else a new one. */
static PyObject *window(PyObject **slot, const unsigned char *buf, Py_ssize_t len, int readonly)
{
    WindowObject *w = (WindowObject *)*slot;
    if (w == NULL || Py_REFCNT(w) != 1 || w->exports != 0) {
        window_drop(slot);
        w = PyObject_New(WindowObject, &WindowType);
        if (w == NULL)
            return NULL;
        w->exports = 0;
        *slot = (PyObject *)w;
    }
    w->buf = (char *)buf;
    w->len = len;
    w->readonly = readonly;
    return (PyObject *)w;
}

/* The four arguments of a cipher call, and room for associated data built per record. */
typedef struct {
    PyObject *slot[4];
    unsigned char *scratch;
    Py_ssize_t scratch_size;
} Calls;

static void calls_clear(Calls *c)
{
    for (int i = 0; i < 4; i++)
        window_drop(&c->slot[i]);
    PyMem_Free(c->scratch);
    c->scratch = NULL;
    c->scratch_size = 0;
}

/* The associated data of a value bound to its key: base || 00, or base || 01 || key, in the
   scratch room; NULL with MemoryError set. */
static const unsigned char *bound_aad(Calls *c, PyObject *base, const unsigned char *key, Py_ssize_t key_len,
                                      Py_ssize_t *size)
{
    Py_ssize_t n = PyBytes_GET_SIZE(base);
    *size = n + 1 + (key_len > 0 ? key_len : 0);
    if (*size > c->scratch_size) {
        unsigned char *grown = PyMem_Realloc(c->scratch, (size_t)*size);
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        c->scratch = grown;
        c->scratch_size = *size;
    }
    memcpy(c->scratch, PyBytes_AS_STRING(base), (size_t)n);
    c->scratch[n] = key_len < 0 ? 0 : 1;
    if (key_len > 0)
        memcpy(c->scratch + n + 1, key, (size_t)key_len);
    return c->scratch;
}

/* cipher(nonce, data, aad, out) through windows onto the bytes; 0, or -1 with the exception set. */
static int aead_call(Calls *c, PyObject *cipher, const unsigned char *nonce, const unsigned char *data,
                     Py_ssize_t data_len, const unsigned char *aad, Py_ssize_t aad_len, unsigned char *out,
                     Py_ssize_t out_len)
{
    PyObject *a[4] = {
        window(&c->slot[0], nonce, NONCE, 1),
        window(&c->slot[1], data, data_len, 1),
        window(&c->slot[2], aad, aad_len, 1),
        window(&c->slot[3], out, out_len, 0),
    };
    if (a[0] == NULL || a[1] == NULL || a[2] == NULL || a[3] == NULL)
        return -1;
    PyObject *r = PyObject_Vectorcall(cipher, a, 4, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *concat(PyObject *a, PyObject *b)
{
    PyObject *out = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(a) + PyBytes_GET_SIZE(b));
    if (out != NULL) {
        memcpy(PyBytes_AS_STRING(out), PyBytes_AS_STRING(a), (size_t)PyBytes_GET_SIZE(a));
        memcpy(PyBytes_AS_STRING(out) + PyBytes_GET_SIZE(a), PyBytes_AS_STRING(b), (size_t)PyBytes_GET_SIZE(b));
    }
    return out;
}

static unsigned char *put(unsigned char *w, const unsigned char *src, Py_ssize_t n)
{
    if (n > 0)
        memcpy(w, src, (size_t)n);
    return w + (n > 0 ? n : 0);
}

static Py_ssize_t record_size(const Rec *r, Py_ssize_t key_len, Py_ssize_t value_len)
{
    Py_ssize_t body = (r->head_end - r->head) + zigzag_size(key_len) + (key_len > 0 ? key_len : 0)
                      + zigzag_size(value_len) + (value_len > 0 ? value_len : 0) + (r->stop - r->tail);
    return zigzag_size(body) + body;
}

typedef struct {
    Py_ssize_t n;
    PyObject *cipher;      /* borrowed: encrypt_into */
    PyObject *vhead;       /* borrowed bytes */
    PyObject *khead;       /* borrowed bytes, or NULL when keys stay plain */
    PyObject *vbase;       /* new: vhead || value suffix */
    PyObject *kaad;        /* new: khead || key suffix, or NULL */
    int bound;
} Run;

PyDoc_STRVAR(seal_records_doc,
"seal_records(records, count, runs, nonces, value_suffix, key_suffix, reserve) -> (bytearray, values sealed)\n\n"
"The `count` records of an uncompressed v2 records section with each non-null value (and, for runs\n"
"with a key header, each non-null key) sealed, after `reserve` zero bytes. `runs` is a list of\n"
"(record count, encrypt_into, value header, key header or None) covering the records in order;\n"
"`nonces` holds 12 bytes per sealed part, taken in record order, a record's key before its value.\n"
"ValueError((reason, position)) when a record does not fit, as split_records.");

static PyObject *seal_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "seal_records() takes 7 arguments");
        return NULL;
    }
    PyObject *src = args[0], *runs_list = args[2], *vsuf = args[4], *ksuf = args[5];
    Py_ssize_t count = PyLong_AsSsize_t(args[1]), reserve = PyLong_AsSsize_t(args[6]);
    if ((count == -1 || reserve == -1) && PyErr_Occurred())
        return NULL;
    if (!PyList_Check(runs_list) || !PyBytes_Check(vsuf) || !PyBytes_Check(ksuf) || reserve < 0) {
        PyErr_SetString(PyExc_TypeError, "seal_records() takes a list of runs, bytes suffixes and a reserve >= 0");
        return NULL;
    }
    Py_ssize_t nruns = PyList_GET_SIZE(runs_list);
    Py_buffer view, nonce_view;
    if (PyObject_GetBuffer(src, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[3], &nonce_view, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const unsigned char *b = view.buf, *nonces = nonce_view.buf;
    Py_ssize_t end = view.len;
    PyObject *out = NULL, *result = NULL;
    Calls calls = {{NULL, NULL, NULL, NULL}, NULL, 0};
    Run *runs = PyMem_Calloc((size_t)nruns + 1, sizeof(Run));
    if (runs == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t covered = 0;
    for (Py_ssize_t i = 0; i < nruns; i++) {
        PyObject *t = PyList_GET_ITEM(runs_list, i);
        Run *run = &runs[i];
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
            PyErr_SetString(PyExc_TypeError, "a run is (count, encrypt_into, value header, key header or None)");
            goto fail;
        }
        run->n = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 0));
        if (run->n == -1 && PyErr_Occurred())
            goto fail;
        run->cipher = PyTuple_GET_ITEM(t, 1);
        run->vhead = PyTuple_GET_ITEM(t, 2);
        run->khead = PyTuple_GET_ITEM(t, 3) == Py_None ? NULL : PyTuple_GET_ITEM(t, 3);
        if (run->n < 0 || !PyBytes_Check(run->vhead) || PyBytes_GET_SIZE(run->vhead) < 7
                || (run->khead != NULL && (!PyBytes_Check(run->khead) || PyBytes_GET_SIZE(run->khead) < 7))) {
            PyErr_SetString(PyExc_ValueError, "a run's headers are envelope headers (bytes)");
            goto fail;
        }
        run->bound = PyBytes_AS_STRING(run->vhead)[6] & FLAG_KEY_BOUND;
        if ((run->vbase = concat(run->vhead, vsuf)) == NULL)
            goto fail;
        if (run->khead != NULL && (run->kaad = concat(run->khead, ksuf)) == NULL)
            goto fail;
        covered += run->n;
    }
    if (count < 0 || count > end) {
        split_fail(PyUnicode_FromFormat("record count %zd cannot fit in %zd bytes", count, end), 0);
        goto fail;
    }
    /* Pass 1: every record is checked (a broken batch fails before anything is sealed) and sized. */
    Py_ssize_t pos = 0, total = 0, needed = 0, values = 0, ri = 0, left = nruns ? runs[0].n : 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Rec r;
        if (parse_record(b, end, &pos, &r) < 0)
            goto fail;
        while (left == 0 && ri + 1 < nruns)
            left = runs[++ri].n;
        if (left == 0)
            break;     /* reported below: the runs do not cover the records */
        left--;
        const Run *run = &runs[ri];
        Py_ssize_t kl = r.key_len, vl = r.value_len;
        if (run->khead != NULL && kl >= 0) {
            kl += PyBytes_GET_SIZE(run->khead) + NONCE + TAG;
            needed++;
        }
        if (vl >= 0) {
            vl += PyBytes_GET_SIZE(run->vhead) + NONCE + TAG;
            needed++;
            values++;
        }
        total += record_size(&r, kl, vl);
    }
    if (covered != count) {
        PyErr_Format(PyExc_ValueError, "the runs cover %zd records, the batch holds %zd", covered, count);
        goto fail;
    }
    if (pos != end) {
        split_fail(PyUnicode_FromFormat("%zd bytes remain after the last of %zd records", end - pos, count), pos);
        goto fail;
    }
    if (nonce_view.len < needed * NONCE) {
        PyErr_Format(PyExc_ValueError, "%zd sealed parts need %zd bytes of nonces, got %zd", needed,
                     needed * NONCE, nonce_view.len);
        goto fail;
    }
    out = PyByteArray_FromStringAndSize(NULL, reserve + total);
    if (out == NULL)
        goto fail;
    unsigned char *base = (unsigned char *)PyByteArray_AS_STRING(out), *w = base + reserve;
    memset(base, 0, (size_t)reserve);
    /* Pass 2: the records written, each sealed part encrypted in place by the caller's cipher. */
    pos = 0;
    ri = 0;
    left = nruns ? runs[0].n : 0;
    const unsigned char *nonce = nonces;
    for (Py_ssize_t i = 0; i < count; i++) {
        Rec r;
        if (parse_record(b, end, &pos, &r) < 0)
            goto fail;
        while (left == 0 && ri + 1 < nruns)
            left = runs[++ri].n;
        left--;
        const Run *run = &runs[ri];
        Py_ssize_t khl = run->khead != NULL ? PyBytes_GET_SIZE(run->khead) : 0;
        Py_ssize_t vhl = PyBytes_GET_SIZE(run->vhead);
        Py_ssize_t kl = r.key_len, vl = r.value_len;
        int seal_key = run->khead != NULL && kl >= 0;
        if (seal_key)
            kl += khl + NONCE + TAG;
        if (vl >= 0)
            vl += vhl + NONCE + TAG;
        Py_ssize_t inner = (r.head_end - r.head) + zigzag_size(kl) + (kl > 0 ? kl : 0) + zigzag_size(vl)
                           + (vl > 0 ? vl : 0) + (r.stop - r.tail);
        w = write_zigzag(w, inner);
        w = put(w, b + r.head, r.head_end - r.head);
        w = write_zigzag(w, kl);
        if (seal_key) {
            w = put(w, (const unsigned char *)PyBytes_AS_STRING(run->khead), khl);
            w = put(w, nonce, NONCE);
            nonce += NONCE;
            if (aead_call(&calls, run->cipher, w - NONCE, b + r.key, r.key_len,
                          (const unsigned char *)PyBytes_AS_STRING(run->kaad), PyBytes_GET_SIZE(run->kaad), w,
                          r.key_len + TAG) < 0)
                goto fail;
            w += r.key_len + TAG;
        } else {
            w = put(w, b + r.key, kl);
        }
        w = write_zigzag(w, vl);
        if (r.value_len >= 0) {
            const unsigned char *aad = (const unsigned char *)PyBytes_AS_STRING(run->vbase);
            Py_ssize_t aad_len = PyBytes_GET_SIZE(run->vbase);
            if (run->bound && (aad = bound_aad(&calls, run->vbase, b + r.key, r.key_len, &aad_len)) == NULL)
                goto fail;
            w = put(w, (const unsigned char *)PyBytes_AS_STRING(run->vhead), vhl);
            w = put(w, nonce, NONCE);
            nonce += NONCE;
            if (aead_call(&calls, run->cipher, w - NONCE, b + r.value, r.value_len, aad, aad_len, w,
                          r.value_len + TAG) < 0)
                goto fail;
            w += r.value_len + TAG;
        }
        w = put(w, b + r.tail, r.stop - r.tail);
    }
    if (w != base + reserve + total) {
        PyErr_SetString(PyExc_RuntimeError, "seal_records wrote other than it sized");
        goto fail;
    }
    result = Py_BuildValue("(On)", out, values);
fail:
    Py_CLEAR(out);
    if (runs != NULL) {
        for (Py_ssize_t i = 0; i < nruns; i++) {
            Py_XDECREF(runs[i].vbase);
            Py_XDECREF(runs[i].kaad);
        }
        PyMem_Free(runs);
    }
    calls_clear(&calls);
    PyBuffer_Release(&nonce_view);
    PyBuffer_Release(&view);
    return result;
}

/* The header a run of sealed parts shares, as the caller's lookup described it. */
typedef struct {
    const unsigned char *at;   /* where it was first seen, in the records section */
    Py_ssize_t size;
    int bound;
    PyObject *cipher;          /* new: decrypt_into */
    PyObject *aad;             /* new: header || suffix */
} Head;

static void head_clear(Head *h)
{
    Py_CLEAR(h->cipher);
    Py_CLEAR(h->aad);
    h->at = NULL;
    h->size = 0;
}

static PyObject *raise_tampered(PyObject *tampered, Py_ssize_t index, const char *reason)
{
    PyObject *exc = PyObject_CallFunction(tampered, "ns", index, reason);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* The header of the sealed part at b[at:at+len]: the last one when it starts the same, else the
   caller's lookup(view, index) -> (header size, flags, decrypt_into), which raises for a malformed
   header or a DEK it does not have. 0, or -1 with the exception set. */
static int find_head(Head *h, PyObject *src, const unsigned char *b, Py_ssize_t at, Py_ssize_t len,
                     PyObject *lookup, PyObject *suffix, Py_ssize_t index)
{
    if (h->at != NULL && len >= h->size && memcmp(b + at, h->at, (size_t)h->size) == 0)
        return 0;
    /* A slice of the caller's object (it holds the bytes alive, whatever lookup keeps). */
    PyObject *part = PySequence_GetSlice(src, at, at + len);
    if (part == NULL)
        return -1;
    PyObject *idx = PyLong_FromSsize_t(index);
    PyObject *got = idx != NULL ? PyObject_CallFunctionObjArgs(lookup, part, idx, NULL) : NULL;
    Py_DECREF(part);
    Py_XDECREF(idx);
    if (got == NULL)
        return -1;
    Py_ssize_t size;
    long flags;
    PyObject *cipher;
    if (!PyTuple_Check(got) || PyTuple_GET_SIZE(got) != 3) {
        Py_DECREF(got);
        PyErr_SetString(PyExc_TypeError, "lookup() returns (header size, flags, decrypt_into)");
        return -1;
    }
    size = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 0));
    flags = PyLong_AsLong(PyTuple_GET_ITEM(got, 1));
    cipher = PyTuple_GET_ITEM(got, 2);
    if (PyErr_Occurred() || size < 7 || size > len) {
        Py_DECREF(got);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "lookup() gave a header size outside the part");
        return -1;
    }
    PyObject *aad = PyBytes_FromStringAndSize(NULL, size + PyBytes_GET_SIZE(suffix));
    if (aad == NULL) {
        Py_DECREF(got);
        return -1;
    }
    memcpy(PyBytes_AS_STRING(aad), b + at, (size_t)size);
    memcpy(PyBytes_AS_STRING(aad) + size, PyBytes_AS_STRING(suffix), (size_t)PyBytes_GET_SIZE(suffix));
    head_clear(h);
    Py_INCREF(cipher);
    h->cipher = cipher;
    h->aad = aad;
    h->at = b + at;
    h->size = size;
    h->bound = (flags & FLAG_KEY_BOUND) != 0;
    Py_DECREF(got);
    return 0;
}

PyDoc_STRVAR(open_records_doc,
"open_records(records, count, lookup, value_suffix, key_suffix, tampered, invalid_tag, reserve)\n"
"    -> (bytearray, values opened, plain values, keys opened)\n\n"
"The `count` records of an uncompressed v2 records section with each sealed value opened (and each\n"
"sealed key, when the batch's first non-null key is sealed), after `reserve` zero bytes; plain and\n"
"null parts as they were. lookup(view, index) -> (header size, flags, decrypt_into) describes a\n"
"header not seen just before. A record that fails raises tampered(index, reason) (the cipher's\n"
"`invalid_tag` becomes that too). ValueError((reason, position)) when a record does not fit.\n\n"
"open_records(..., reserve, into, at) -> (end, values opened, plain values, keys opened) writes the same\n"
"bytes into the bytearray `into` from `at` instead (it must hold reserve + len(records) bytes from\n"
"there; an opened record is never longer than the sealed one) and gives the offset after them, so a\n"
"partition's batches are opened one after another into one buffer.");

static PyObject *open_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 8 && nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "open_records() takes 8 or 10 arguments");
        return NULL;
    }
    PyObject *src = args[0], *lookup = args[2], *vsuf = args[3], *ksuf = args[4];
    PyObject *tampered = args[5], *invalid_tag = args[6];
    PyObject *into = nargs == 10 ? args[8] : NULL;
    Py_ssize_t count = PyLong_AsSsize_t(args[1]), reserve = PyLong_AsSsize_t(args[7]);
    Py_ssize_t at = into != NULL ? PyLong_AsSsize_t(args[9]) : 0;
    if ((count == -1 || reserve == -1 || at == -1) && PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(vsuf) || !PyBytes_Check(ksuf) || reserve < 0 || at < 0
            || (into != NULL && !PyByteArray_Check(into))) {
        PyErr_SetString(PyExc_TypeError, "open_records() takes bytes suffixes, a reserve >= 0 and a bytearray "
                                         "with an offset >= 0");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(src, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *b = view.buf;
    Py_ssize_t end = view.len;
    /* Held while writing: nothing can resize `into` under the pointer (lookup runs Python). */
    Py_buffer into_view = {0};
    int into_held = 0;
    PyObject *out = NULL, *result = NULL;
    Head kh = {0}, vh = {0};
    Calls calls = {{NULL, NULL, NULL, NULL}, NULL, 0};
    Py_ssize_t opened = 0, plain = 0;
    int open_keys = -1;
    if (count < 0 || count > end) {
        split_fail(PyUnicode_FromFormat("record count %zd cannot fit in %zd bytes", count, end), 0);
        goto done;
    }
    /* Pass 1: every record is checked before anything is opened; the first non-null key says
       whether the batch's keys are sealed (kproxy seals all of a batch's keys or none). */
    Py_ssize_t pos = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Rec r;
        if (parse_record(b, end, &pos, &r) < 0)
            goto done;
        if (open_keys < 0 && r.key_len >= 0)
            open_keys = sealed_part(b, r.key, r.key_len);
    }
    if (pos != end) {
        split_fail(PyUnicode_FromFormat("%zd bytes remain after the last of %zd records", end - pos, count), pos);
        goto done;
    }
    open_keys = open_keys > 0;
    /* An opened record is never longer than the sealed one: the input's size bounds the output. */
    unsigned char *base;
    if (into != NULL) {
        if (PyObject_GetBuffer(into, &into_view, PyBUF_WRITABLE) < 0)
            goto done;
        into_held = 1;
        if (into_view.len < at || into_view.len - at < reserve + end) {
            PyErr_SetString(PyExc_ValueError, "open_records(): no room for the records in `into` from `at`");
            goto done;
        }
        base = (unsigned char *)into_view.buf + at;
    } else {
        out = PyByteArray_FromStringAndSize(NULL, reserve + end);
        if (out == NULL)
            goto done;
        base = (unsigned char *)PyByteArray_AS_STRING(out);
    }
    unsigned char *w = base + reserve;
    memset(base, 0, (size_t)reserve);
    pos = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Rec r;
        if (parse_record(b, end, &pos, &r) < 0)
            goto fail;
        int open_key = open_keys && r.key_len >= 0 && sealed_part(b, r.key, r.key_len);
        int open_value = r.value_len >= 0 && sealed_part(b, r.value, r.value_len);
        Py_ssize_t kl = r.key_len, vl = r.value_len;
        if (open_key) {
            if (find_head(&kh, src, b, r.key, r.key_len, lookup, ksuf, i) < 0)
                goto fail;
            if (kh.bound) {
                raise_tampered(tampered, i, "a sealed key is bound to a key");
                goto fail;
            }
            if (r.key_len < kh.size + NONCE + TAG) {
                raise_tampered(tampered, i, "too short for a nonce and a tag");
                goto fail;
            }
            kl = r.key_len - kh.size - NONCE - TAG;
        }
        if (open_value) {
            if (find_head(&vh, src, b, r.value, r.value_len, lookup, vsuf, i) < 0)
                goto fail;
            if (r.value_len < vh.size + NONCE + TAG) {
                raise_tampered(tampered, i, "too short for a nonce and a tag");
                goto fail;
            }
            vl = r.value_len - vh.size - NONCE - TAG;
        } else if (r.value_len >= 0) {
            plain++;
        }
        Py_ssize_t inner = (r.head_end - r.head) + zigzag_size(kl) + (kl > 0 ? kl : 0) + zigzag_size(vl)
                           + (vl > 0 ? vl : 0) + (r.stop - r.tail);
        w = write_zigzag(w, inner);
        w = put(w, b + r.head, r.head_end - r.head);
        w = write_zigzag(w, kl);
        const unsigned char *key = w;     /* the record's plaintext key, once written */
        if (open_key) {
            const unsigned char *n = b + r.key + kh.size;
            if (aead_call(&calls, kh.cipher, n, n + NONCE, r.key_len - kh.size - NONCE,
                          (const unsigned char *)PyBytes_AS_STRING(kh.aad), PyBytes_GET_SIZE(kh.aad), w, kl) < 0)
                goto crypto_fail;
            w += kl;
        } else {
            w = put(w, b + r.key, kl);
        }
        w = write_zigzag(w, vl);
        if (open_value) {
            const unsigned char *n = b + r.value + vh.size;
            const unsigned char *aad = (const unsigned char *)PyBytes_AS_STRING(vh.aad);
            Py_ssize_t aad_len = PyBytes_GET_SIZE(vh.aad);
            if (vh.bound && (aad = bound_aad(&calls, vh.aad, key, kl, &aad_len)) == NULL)
                goto fail;
            if (aead_call(&calls, vh.cipher, n, n + NONCE, r.value_len - vh.size - NONCE, aad, aad_len, w, vl) < 0)
                goto crypto_fail;
            w += vl;
            opened++;
        } else {
            w = put(w, b + r.value, vl);
        }
        w = put(w, b + r.tail, r.stop - r.tail);
        continue;
crypto_fail:
        if (PyErr_ExceptionMatches(invalid_tag)) {
            PyErr_Clear();
            raise_tampered(tampered, i, "authentication failed (the record, its envelope, topic or key was changed)");
        }
        goto fail;
    }
    if (into != NULL) {
        result = Py_BuildValue("(nnnO)", at + (w - base), opened, plain, open_keys ? Py_True : Py_False);
        goto fail;
    }
    if (PyByteArray_Resize(out, w - base) < 0)
        goto fail;
    result = Py_BuildValue("(OnnO)", out, opened, plain, open_keys ? Py_True : Py_False);
fail:
    Py_XDECREF(out);
done:
    head_clear(&kh);
    head_clear(&vh);
    /* The windows onto `into` are closed before it may be resized again. */
    calls_clear(&calls);
    if (into_held)
        PyBuffer_Release(&into_view);
    PyBuffer_Release(&view);
    return result;
}

/* ---------------------------------------------------------------------------------------------
   Compiled decoding (Decoder): the decode of one message version done here, building the same
   generated classes' instances the Python decoder builds, from a program the compiler emits from
   the same schema (kproxy/protocol/codegen/decode_program.py documents the rows and opcodes).

   It is a fast path, not a second reference: whatever it does not handle (bytes it would reject, a
   known tagged field, an array of structs long enough to stay lazy, a buffer that is not a contiguous
   memoryview) it hands, untouched, to the generated Python decoder, which decides and reports. So it
   never accepts what the Python decoder rejects (every read is checked against `end`, as strictly or
   more strictly than there) and builds equal values when it accepts: tests/protocol/test_compiled.py
   checks both, value for value and byte for byte. Instances are allocated directly and their slots
   set at the offsets of the classes' member descriptors: the generated __init__ only stores its
   arguments, so skipping it changes nothing but the cost. */

enum {
    D_FIXED = 1,      /* slot type: a fixed-width value (type: DT_*) */
    D_STRING = 2,     /* slot compact nullable: a string */
    D_BYTES = 3,      /* slot compact nullable: bytes or records, a memoryview slice of the input */
    D_ARRFIX = 4,     /* slot compact nullable type: an array of fixed-width values */
    D_ARRBLOB = 5,    /* slot compact nullable isbytes: an array of strings or bytes (never null) */
    D_ARRSTRUCT = 6,  /* slot compact nullable sid min_elem: an array of structs */
    D_STRUCT = 7,     /* slot sid: a struct */
    D_NSTRUCT = 8,    /* slot sid: a nullable struct (int8 marker, negative = null) */
    D_TAGS = 9,       /* nknown tag*nknown: the tagged-field section; a known tag falls back */
};
/* Must match codegen/decode_program.py's DECODER_ABI; bump it when a program's encoding changes. */
#define DECODER_ABI 1
static const int D_ARGS[] = {0, 2, 3, 3, 4, 4, 5, 2, 2, -1};
enum { DT_INT8, DT_INT16, DT_INT32, DT_INT64, DT_UINT16, DT_UINT32, DT_FLOAT64, DT_BOOL, DT_UUID };
static const int DT_SIZE[] = {1, 2, 4, 8, 2, 4, 8, 1, 16};
/* Defaults of slots no opcode sets: a constant, a fresh list, or the value of calling a class. */
enum { DEF_SET = 0, DEF_CONST = 1, DEF_LIST = 2, DEF_CALL = 3 };
#define D_MAX_SLOTS 64

typedef struct {
    PyTypeObject *cls;
    Py_ssize_t nfields;     /* slots 0..nfields-1 are the fields; then _unknown, _explicit[, _version] */
    Py_ssize_t nslots;
    Py_ssize_t offsets[D_MAX_SLOTS];
    int dkind[D_MAX_SLOTS];
    PyObject *dvalue[D_MAX_SLOTS];  /* borrowed from DecoderObject.rows */
    int64_t *ops;
    Py_ssize_t nops;
} DRow;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *rows_obj;     /* the rows tuple, which owns classes and defaults */
    PyObject *fallback;     /* the generated Python decoder of the root */
    PyObject *make_uuid;
    PyObject *version;
    Py_ssize_t lazy_min;
    ProgramObject *skip;    /* the validating skip of lazy arrays, or NULL: they fall back */
    PyObject *lazy_cls;     /* LazyArray */
    PyObject *lazy_rows;    /* per row: None, or (skip program's struct id, the Python da_ function) */
    Py_ssize_t nrows;
    DRow *rows;
    Py_ssize_t hits, fallbacks;
} DecoderObject;

typedef struct {
    const DecoderObject *d;
    const uint8_t *buf;
    PyObject *mv;
    PyObject **spans;  /* the message's span dict for its lazy arrays, made when the first is */
} DCtx;

static void decoder_dealloc(DecoderObject *self)
{
    if (self->rows != NULL)
        for (Py_ssize_t i = 0; i < self->nrows; i++)
            PyMem_Free(self->rows[i].ops);
    PyMem_Free(self->rows);
    Py_XDECREF(self->rows_obj);
    Py_XDECREF(self->fallback);
    Py_XDECREF(self->make_uuid);
    Py_XDECREF(self->version);
    Py_XDECREF(self->skip);
    Py_XDECREF(self->lazy_cls);
    Py_XDECREF(self->lazy_rows);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static uint64_t be_u(const uint8_t *p, int width)
{
    uint64_t v = 0;
    for (int i = 0; i < width; i++)
        v = (v << 8) | p[i];
    return v;
}

/* The functions below return a new reference, or NULL: with a Python error set for a real failure
   (memory), without one to mean "hand this message to the Python decoder". */

static PyObject *d_fixed(const DCtx *c, int type, Py_ssize_t *pos, Py_ssize_t end)
{
    int w = DT_SIZE[type];
    if (end - *pos < w)
        return NULL;
    const uint8_t *p = c->buf + *pos;
    *pos += w;
    switch (type) {
        case DT_INT8: return PyLong_FromLong((int8_t)p[0]);
        case DT_INT16: return PyLong_FromLong((int16_t)be_u(p, 2));
        case DT_INT32: return PyLong_FromLong((int32_t)be_u(p, 4));
        case DT_INT64: return PyLong_FromLongLong((int64_t)be_u(p, 8));
        case DT_UINT16: return PyLong_FromLong((long)be_u(p, 2));
        case DT_UINT32: return PyLong_FromUnsignedLong((unsigned long)be_u(p, 4));
        case DT_FLOAT64: return PyFloat_FromDouble(PyFloat_Unpack8((const char *)p, 0));
        case DT_BOOL: return Py_NewRef(p[0] ? Py_True : Py_False);
        default: {
            PyObject *hi = PyLong_FromUnsignedLongLong(be_u(p, 8));
            PyObject *lo = hi ? PyLong_FromUnsignedLongLong(be_u(p + 8, 8)) : NULL;
            PyObject *u = lo ? PyObject_CallFunctionObjArgs(c->d->make_uuid, hi, lo, NULL) : NULL;
            Py_XDECREF(hi);
            Py_XDECREF(lo);
            return u;
        }
    }
}

/* A length (strings: width 2, else 4) or a compact one; null is n == -1. -2: not acceptable here. */
static int d_len(const DCtx *c, Py_ssize_t *pos, Py_ssize_t end, int compact, int width, int nullable,
                 int64_t *n)
{
    return read_count(c->buf, pos, end, compact, width, nullable, n);
}

static PyObject *d_blob(const DCtx *c, int isbytes, Py_ssize_t *pos, Py_ssize_t end, int compact,
                        int nullable)
{
    int64_t n;
    if (d_len(c, pos, end, compact, isbytes ? 4 : 2, nullable, &n))
        return NULL;
    if (n == -1)
        return Py_NewRef(Py_None);
    if (n > end - *pos)
        return NULL;
    Py_ssize_t at = *pos;
    *pos += (Py_ssize_t)n;
    if (isbytes)
        return PySequence_GetSlice(c->mv, at, at + (Py_ssize_t)n);
    return PyUnicode_DecodeUTF8((const char *)c->buf + at, (Py_ssize_t)n, "surrogateescape");
}

static PyObject *d_struct(const DCtx *c, Py_ssize_t sid, Py_ssize_t *pos, Py_ssize_t end, int depth);

/* A LazyArray of n structs sid starting at *pos (its count at start), after the validating skip the
   Python decoder runs: as it does, LazyArray(buf, start, pos, end_of_array, n, da_<struct>, spans). */
static PyObject *d_lazy(const DCtx *c, int64_t sid, Py_ssize_t start, Py_ssize_t *pos, Py_ssize_t end,
                        int64_t n)
{
    const DecoderObject *d = c->d;
    if (d->skip == NULL)
        return NULL;
    PyObject *entry = PyTuple_GET_ITEM(d->lazy_rows, sid);
    if (entry == Py_None)
        return NULL;
    if (*c->spans == NULL && (*c->spans = PyDict_New()) == NULL)
        return NULL;
    Ctx sc = {c->buf, d->skip, *c->spans, d->lazy_min};
    Py_ssize_t e = run(&sc, PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0)), *pos, end, n, 0);
    if (e < 0)
        return NULL;  /* -2 left a Python error set; -1 is bad bytes, which the fallback reports */
    PyObject *args[7] = {c->mv, NULL, NULL, NULL, NULL, PyTuple_GET_ITEM(entry, 1), *c->spans};
    PyObject *result = NULL;
    if ((args[1] = PyLong_FromSsize_t(start)) && (args[2] = PyLong_FromSsize_t(*pos))
            && (args[3] = PyLong_FromSsize_t(e)) && (args[4] = PyLong_FromLongLong(n)))
        result = PyObject_Vectorcall(d->lazy_cls, args, 7, NULL);
    for (int i = 1; i < 5; i++)
        Py_XDECREF(args[i]);
    if (result != NULL)
        *pos = e;
    return result;
}

static PyObject *d_array(const DCtx *c, const int64_t *op, Py_ssize_t *pos, Py_ssize_t end, int depth)
{
    int code = (int)op[0], compact = (int)op[2], nullable = (int)op[3];
    int64_t n, unit;
    Py_ssize_t start = *pos;
    if (d_len(c, pos, end, compact, 4, nullable, &n))
        return NULL;
    if (n == -1)
        return Py_NewRef(Py_None);
    if (code == D_ARRFIX)
        unit = DT_SIZE[op[4]];
    else if (code == D_ARRBLOB)
        unit = compact ? 1 : (op[4] ? 4 : 2);
    else
        unit = op[5];
    /* A list is made only for elements the bytes can hold (an element of no bytes is not bounded
       by them: the Python decoder decides). */
    if (unit <= 0 || n * unit > end - *pos)
        return NULL;
    if (code == D_ARRSTRUCT && (c->d->lazy_min == 0 || n >= c->d->lazy_min))
        return d_lazy(c, op[4], start, pos, end, n);
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++) {
        PyObject *e;
        if (code == D_ARRFIX)
            e = d_fixed(c, (int)op[4], pos, end);
        else if (code == D_ARRBLOB)
            e = d_blob(c, (int)op[4], pos, end, compact, 0);
        else
            e = d_struct(c, (Py_ssize_t)op[4], pos, end, depth + 1);
        if (e == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, e);
    }
    return list;
}

static PyObject *d_struct(const DCtx *c, Py_ssize_t sid, Py_ssize_t *pos, Py_ssize_t end, int depth)
{
    if (depth > MAX_DEPTH)
        return NULL;
    const DRow *r = &c->d->rows[sid];
    PyObject *v[D_MAX_SLOTS];
    PyObject *result = NULL, *unk = NULL;
    memset(v, 0, sizeof(PyObject *) * (size_t)r->nslots);
    const int64_t *op = r->ops, *stop = r->ops + r->nops;
    while (op < stop) {
        int64_t code = op[0];
        PyObject *x;
        switch (code) {
            case D_FIXED:
                x = d_fixed(c, (int)op[2], pos, end);
                break;
            case D_STRING:
            case D_BYTES:
                x = d_blob(c, code == D_BYTES, pos, end, (int)op[2], (int)op[3]);
                break;
            case D_ARRFIX:
            case D_ARRBLOB:
            case D_ARRSTRUCT:
                x = d_array(c, op, pos, end, depth);
                break;
            case D_STRUCT:
                x = d_struct(c, (Py_ssize_t)op[2], pos, end, depth + 1);
                break;
            case D_NSTRUCT:
                if (*pos >= end)
                    goto done;
                if (c->buf[(*pos)++] >= 128)
                    x = Py_NewRef(Py_None);
                else
                    x = d_struct(c, (Py_ssize_t)op[2], pos, end, depth + 1);
                break;
            default: { /* D_TAGS */
                int64_t nt, tag, sz;
                if (read_uv(c->buf, pos, end, &nt) || nt > end - *pos)
                    goto done;
                for (int64_t t = 0; t < nt; t++) {
                    if (read_uv(c->buf, pos, end, &tag) || read_uv(c->buf, pos, end, &sz) || sz > end - *pos)
                        goto done;
                    for (int64_t k = 0; k < op[1]; k++)
                        if (op[2 + k] == tag)
                            goto done;  /* a known tagged field: the Python decoder reads it */
                    if (unk == NULL && (unk = PyList_New(0)) == NULL)
                        goto done;
                    PyObject *data = PySequence_GetSlice(c->mv, *pos, *pos + (Py_ssize_t)sz);
                    PyObject *item = data ? Py_BuildValue("(LN)", (long long)tag, data) : NULL;
                    if (item == NULL || PyList_Append(unk, item) < 0) {
                        Py_XDECREF(item);
                        goto done;
                    }
                    Py_DECREF(item);
                    *pos += (Py_ssize_t)sz;
                }
                op += 2 + op[1];
                continue;
            }
        }
        if (x == NULL)
            goto done;
        v[op[1]] = x;
        op += 1 + D_ARGS[code];
    }
    for (Py_ssize_t i = 0; i < r->nfields; i++) {
        if (v[i] != NULL)
            continue;
        switch (r->dkind[i]) {
            case DEF_CONST: v[i] = Py_NewRef(r->dvalue[i]); break;
            case DEF_LIST: v[i] = PyList_New(0); break;
            case DEF_CALL: v[i] = PyObject_CallNoArgs(r->dvalue[i]); break;
            default: break;
        }
        if (v[i] == NULL)
            goto done;
    }
    v[r->nfields] = unk != NULL ? unk : Py_NewRef(Py_None);
    unk = NULL;
    v[r->nfields + 1] = Py_NewRef(Py_None);
    if (r->nslots > r->nfields + 2)
        v[r->nfields + 2] = Py_NewRef(c->d->version);
    result = r->cls->tp_alloc(r->cls, 0);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < r->nslots; i++) {
        *(PyObject **)((char *)result + r->offsets[i]) = v[i];
        v[i] = NULL;
    }
done:
    for (Py_ssize_t i = 0; i < r->nslots; i++)
        Py_XDECREF(v[i]);
    Py_XDECREF(unk);
    return result;
}

static PyObject *decoder_call(PyObject *self_obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    DecoderObject *self = (DecoderObject *)self_obj;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames == NULL && nargs == 3 && PyMemoryView_Check(args[0])) {
        Py_ssize_t pos = PyLong_AsSsize_t(args[1]), end = PyLong_AsSsize_t(args[2]);
        Py_buffer *view = PyMemoryView_GET_BUFFER(args[0]);
        if (PyErr_Occurred()) {
            PyErr_Clear();
        } else if (PyBuffer_IsContiguous(view, 'C') && view->itemsize == 1 && view->buf != NULL
                   && 0 <= pos && pos <= end && end <= view->len) {
            PyObject *spans = NULL;
            DCtx c = {self, (const uint8_t *)view->buf, args[0], &spans};
            PyObject *obj = d_struct(&c, 0, &pos, end, 0);
            Py_XDECREF(spans);
            if (obj != NULL) {
                self->hits++;
                PyObject *p = PyLong_FromSsize_t(pos);
                if (p == NULL) {
                    Py_DECREF(obj);
                    return NULL;
                }
                PyObject *t = PyTuple_New(2);
                if (t == NULL) {
                    Py_DECREF(obj);
                    Py_DECREF(p);
                    return NULL;
                }
                PyTuple_SET_ITEM(t, 0, obj);
                PyTuple_SET_ITEM(t, 1, p);
                return t;
            }
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_ValueError)
                    && !PyErr_ExceptionMatches(PyExc_OverflowError))
                return NULL;  /* memory and the like: not the bytes' fault */
            PyErr_Clear();
        }
    }
    self->fallbacks++;
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

/* Decoder(rows, fallback, make_uuid, version, lazy_min, lazy): rows is a tuple with one row per
   struct, the root first: (cls, slot_names, ops, defaults); slot_names are the fields, then _unknown,
   _explicit and, for the root, _version; defaults has one (kind, value) per field (DEF_*). lazy is
   None (lazy arrays fall back) or (skip Program, LazyArray, per row None or (skip struct id, da_)). */
static PyObject *decoder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *rows, *fallback, *make_uuid, *version, *lazy;
    Py_ssize_t lazy_min;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Decoder() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!OOO!nO:Decoder", &PyTuple_Type, &rows, &fallback, &make_uuid,
                          &PyLong_Type, &version, &lazy_min, &lazy))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(rows);
    if (n < 1 || lazy_min < 0 || !PyCallable_Check(fallback) || !PyCallable_Check(make_uuid))
        goto bad;
    if (lazy != Py_None) {
        if (!PyTuple_Check(lazy) || PyTuple_GET_SIZE(lazy) != 3
                || !PyObject_TypeCheck(PyTuple_GET_ITEM(lazy, 0), &ProgramType)
                || !PyCallable_Check(PyTuple_GET_ITEM(lazy, 1)) || !PyTuple_Check(PyTuple_GET_ITEM(lazy, 2))
                || PyTuple_GET_SIZE(PyTuple_GET_ITEM(lazy, 2)) != n)
            goto bad;
        const ProgramObject *sp = (const ProgramObject *)PyTuple_GET_ITEM(lazy, 0);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *e = PyTuple_GET_ITEM(PyTuple_GET_ITEM(lazy, 2), i);
            if (e == Py_None)
                continue;
            if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 2 || !PyLong_Check(PyTuple_GET_ITEM(e, 0))
                    || !PyCallable_Check(PyTuple_GET_ITEM(e, 1)))
                goto bad;
            Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(e, 0));
            if (k < 0 || k >= sp->nstructs) {
                PyErr_Clear();
                goto bad;
            }
        }
    }
    DecoderObject *self = (DecoderObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = decoder_call;
    self->rows_obj = Py_NewRef(rows);
    self->fallback = Py_NewRef(fallback);
    self->make_uuid = Py_NewRef(make_uuid);
    self->version = Py_NewRef(version);
    self->lazy_min = lazy_min;
    if (lazy != Py_None) {
        self->skip = (ProgramObject *)Py_NewRef(PyTuple_GET_ITEM(lazy, 0));
        self->lazy_cls = Py_NewRef(PyTuple_GET_ITEM(lazy, 1));
        self->lazy_rows = Py_NewRef(PyTuple_GET_ITEM(lazy, 2));
    }
    self->nrows = n;
    self->rows = PyMem_Calloc((size_t)n, sizeof(DRow));
    if (self->rows == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_GET_ITEM(rows, i), *cls, *names, *ops, *defs;
        DRow *r = &self->rows[i];
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 4)
            goto bad_self;
        cls = PyTuple_GET_ITEM(row, 0);
        names = PyTuple_GET_ITEM(row, 1);
        ops = PyTuple_GET_ITEM(row, 2);
        defs = PyTuple_GET_ITEM(row, 3);
        if (!PyType_Check(cls) || !PyTuple_Check(names) || !PyTuple_Check(ops) || !PyTuple_Check(defs))
            goto bad_self;
        r->cls = (PyTypeObject *)cls;
        r->nslots = PyTuple_GET_SIZE(names);
        r->nfields = PyTuple_GET_SIZE(defs);
        if (r->nslots > D_MAX_SLOTS || r->nslots != r->nfields + 2 + (i == 0))
            goto bad_self;
        for (Py_ssize_t j = 0; j < r->nslots; j++) {
            PyObject *d = PyObject_GetAttr(cls, PyTuple_GET_ITEM(names, j));
            if (d == NULL) {
                Py_DECREF(self);
                return NULL;
            }
            int ok = Py_IS_TYPE(d, &PyMemberDescr_Type)
                     && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX
                     && !(((PyMemberDescrObject *)d)->d_member->flags & READONLY)
                     && PyType_IsSubtype(r->cls, ((PyMemberDescrObject *)d)->d_common.d_type);
            if (ok)
                r->offsets[j] = ((PyMemberDescrObject *)d)->d_member->offset;
            Py_DECREF(d);
            if (!ok)
                goto bad_self;
        }
        for (Py_ssize_t j = 0; j < r->nfields; j++) {
            PyObject *dv = PyTuple_GET_ITEM(defs, j);
            if (!PyTuple_Check(dv) || PyTuple_GET_SIZE(dv) != 2)
                goto bad_self;
            long kind = PyLong_AsLong(PyTuple_GET_ITEM(dv, 0));
            if (kind < DEF_SET || kind > DEF_CALL || (kind == DEF_CALL && !PyCallable_Check(PyTuple_GET_ITEM(dv, 1))))
                goto bad_self;
            r->dkind[j] = (int)kind;
            r->dvalue[j] = PyTuple_GET_ITEM(dv, 1);
        }
        r->nops = PyTuple_GET_SIZE(ops);
        r->ops = PyMem_Calloc((size_t)r->nops + 1, sizeof(int64_t));
        if (r->ops == NULL) {
            Py_DECREF(self);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t j = 0; j < r->nops; j++) {
            long long x = PyLong_AsLongLong(PyTuple_GET_ITEM(ops, j));
            if (x == -1 && PyErr_Occurred()) {
                Py_DECREF(self);
                return NULL;
            }
            r->ops[j] = x;
        }
    }
    /* Check every row once, so the interpreter can trust opcodes, arguments, slots and struct ids. */
    for (Py_ssize_t i = 0; i < n; i++) {
        DRow *r = &self->rows[i];
        int set[D_MAX_SLOTS] = {0};
        const int64_t *op = r->ops, *stop = r->ops + r->nops;
        while (op < stop) {
            int64_t code = op[0];
            if (code < D_FIXED || code > D_TAGS)
                goto bad_self;
            Py_ssize_t na = code == D_TAGS ? (op + 1 < stop ? 1 + op[1] : -1) : D_ARGS[code];
            if (na < 0 || op + 1 + na > stop)
                goto bad_self;
            if (code == D_TAGS) {
                if (op + 1 + na != stop)
                    goto bad_self;
                op += 1 + na;
                continue;
            }
            if (op[1] < 0 || op[1] >= r->nfields || set[op[1]]++)
                goto bad_self;
            if ((code == D_FIXED || code == D_ARRFIX) && (op[code == D_FIXED ? 2 : 4] < DT_INT8
                                                          || op[code == D_FIXED ? 2 : 4] > DT_UUID))
                goto bad_self;
            if ((code == D_STRUCT || code == D_NSTRUCT) && (op[2] < 1 || op[2] >= n))
                goto bad_self;
            if (code == D_ARRSTRUCT && (op[4] < 1 || op[4] >= n || op[5] < 1))
                goto bad_self;
            op += 1 + na;
        }
        for (Py_ssize_t j = 0; j < r->nfields; j++)
            if ((r->dkind[j] == DEF_SET) != (set[j] != 0))
                goto bad_self;
    }
    return (PyObject *)self;
bad_self:
    Py_DECREF(self);
bad:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "malformed decode program");
    return NULL;
}

static PyMemberDef decoder_members[] = {
    {"hits", T_PYSSIZET, offsetof(DecoderObject, hits), READONLY,
     "messages decoded here (the compiled path)"},
    {"fallbacks", T_PYSSIZET, offsetof(DecoderObject, fallbacks), READONLY,
     "messages handed to the Python decoder"},
    {"fallback", T_OBJECT, offsetof(DecoderObject, fallback), READONLY, "the Python decoder"},
    {NULL},
};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kproxy.protocol._accel.Decoder",
    .tp_doc = "A compiled decoder of one message version: called as the generated Python decoder is,\n"
              "(buf, pos, end) -> (obj, pos); whatever it does not handle goes to that decoder.",
    .tp_basicsize = sizeof(DecoderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = decoder_new,
    .tp_dealloc = (destructor)decoder_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(DecoderObject, vectorcall),
    .tp_members = decoder_members,
};

/* ---- Produce under metrics alone: what metrics count, read from a relayed exchange's bytes --------

   The compiled twin of kproxy/proxy/produce_bytes.py (the reference and the fallback; a property test
   holds the two equal to the decoder on every Produce version). Laid out as schema/produce.kschema:
   flexible from v9, topic ids from v13. */

static int64_t be32(const uint8_t *p)
{
    return (int64_t)(int32_t)(((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3]);
}

/* The records of the v2 batches in buf[pos:end] into *total; -1 for anything else. */
static int pc_batches(const uint8_t *buf, Py_ssize_t pos, Py_ssize_t end, int64_t *total)
{
    int64_t sum = 0;
    while (pos < end) {
        if (end - pos < 61 || buf[pos + 16] != 2)
            return -1;
        int64_t length = be32(buf + pos + 8), count = be32(buf + pos + 57);
        if (length < 49 || count < 0 || length + 12 > end - pos)
            return -1;
        pos += (Py_ssize_t)(12 + length);
        sum += count;
    }
    *total = sum;
    return 0;
}

static int pc_tags(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end)
{
    int64_t n, tag, size;
    if (read_uv(buf, pos, end, &n))
        return -1;
    for (int64_t i = 0; i < n; i++)
        if (read_uv(buf, pos, end, &tag) || read_uv(buf, pos, end, &size) || skip_bytes(pos, end, size))
            return -1;
    return 0;
}

/* A count (array) or length: compact (uvarint - 1) or classic big-endian of `width`. */
static int pc_count(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, int flexible, int width, int64_t *n)
{
    if (flexible) {
        if (read_uv(buf, pos, end, n))
            return -1;
        *n -= 1;
        return 0;
    }
    return read_be(buf, pos, end, width, n);
}

/* The topic's key: the bytes of its id (v13+) or name, as a new bytes object; NULL with no error
   set when the bytes are not there. */
static PyObject *pc_key(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, int flexible, int by_id)
{
    int64_t n = 16;
    if (!by_id && (pc_count(buf, pos, end, flexible, 2, &n) || n < 0))
        return NULL;
    if (n > end - *pos)
        return NULL;
    PyObject *key = PyBytes_FromStringAndSize((const char *)buf + *pos, (Py_ssize_t)n);
    *pos += (Py_ssize_t)n;
    return key;
}

PyDoc_STRVAR(produce_counts_doc,
"produce_counts(buf, pos, version) -> (acks, total, [(topic key, index, records), ...]) | None\n\n"
"Of a Produce request whose body starts at `pos`: as kproxy.proxy.produce_bytes.request_counts.");

static PyObject *produce_counts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "produce_counts() takes 3 arguments");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]), version = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *buf = view.buf;
    Py_ssize_t end = view.len;
    int flexible = version >= 9, by_id = version >= 13;
    PyObject *counts = NULL, *result = NULL, *key = NULL;
    int64_t n, acks, topics, partitions, index, size, total = 0, records;
    if (pos < 0 || pos > end)
        goto done;
    if (version >= 3 && (pc_count(buf, &pos, end, flexible, 2, &n) || skip_bytes(&pos, end, n > 0 ? n : 0)))
        goto done;
    if (read_be(buf, &pos, end, 2, &acks) || skip_bytes(&pos, end, 4)
            || pc_count(buf, &pos, end, flexible, 4, &topics))
        goto done;
    counts = PyList_New(0);
    if (counts == NULL)
        goto done;
    for (int64_t t = 0; t < topics; t++) {
        Py_CLEAR(key);
        key = pc_key(buf, &pos, end, flexible, by_id);
        if (key == NULL || pc_count(buf, &pos, end, flexible, 4, &partitions))
            goto done;
        for (int64_t i = 0; i < partitions; i++) {
            if (read_be(buf, &pos, end, 4, &index) || pc_count(buf, &pos, end, flexible, 4, &size))
                goto done;
            records = 0;
            if (size > 0) {
                if (size > end - pos || pc_batches(buf, pos, pos + (Py_ssize_t)size, &records))
                    goto done;
                pos += (Py_ssize_t)size;
            }
            PyObject *item = Py_BuildValue("(OLL)", key, (long long)index, (long long)records);
            if (item == NULL || PyList_Append(counts, item) < 0) {
                Py_XDECREF(item);
                goto done;
            }
            Py_DECREF(item);
            total += records;
            if (flexible && pc_tags(buf, &pos, end))
                goto done;
        }
        if (flexible && pc_tags(buf, &pos, end))
            goto done;
    }
    result = Py_BuildValue("(LLO)", (long long)acks, (long long)total, counts);
done:
    Py_XDECREF(key);
    Py_XDECREF(counts);
    PyBuffer_Release(&view);
    if (result == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return result;
}

/* Walks a Produce answer from its correlation id on to its body's closing tagged fields: the partitions
   it reports an error for into *failed (a new set, or left NULL when there are none; not collected
   when failed is NULL) and its throttle time into *throttle. The position of those tagged fields, or
   -1 when the bytes run out or are not an answer (with a Python error set only when one was raised).
   With failed NULL it touches no Python object (key stays NULL): the lane runs it so, without the GIL. */
static Py_ssize_t pa_walk(const uint8_t *buf, Py_ssize_t end, Py_ssize_t version, PyObject **failed,
                          int64_t *throttle)
{
    Py_ssize_t pos = 4;
    int flexible = version >= 9, by_id = version >= 13;
    Py_ssize_t fixed = 14 + (version >= 2 ? 8 : 0) + (version >= 5 ? 8 : 0);
    PyObject *key = NULL;
    int64_t topics, partitions, n;
    *throttle = 0;
    if (end < 4 || (flexible && pc_tags(buf, &pos, end)) || pc_count(buf, &pos, end, flexible, 4, &topics))
        goto bad;
    for (int64_t t = 0; t < topics; t++) {
        Py_CLEAR(key);
        if (failed != NULL) {
            key = pc_key(buf, &pos, end, flexible, by_id);
            if (key == NULL)
                goto bad;
        } else if (by_id ? skip_bytes(&pos, end, 16)
                   : pc_count(buf, &pos, end, flexible, 2, &n) || n < 0 || skip_bytes(&pos, end, n)) {
            goto bad;
        }
        if (pc_count(buf, &pos, end, flexible, 4, &partitions))
            goto bad;
        for (int64_t i = 0; i < partitions; i++) {
            if (fixed > end - pos)
                goto bad;
            int64_t index = be32(buf + pos), error = (int16_t)(((uint16_t)buf[pos + 4] << 8) | buf[pos + 5]);
            pos += fixed;
            if (error && failed != NULL) {
                if (*failed == NULL && (*failed = PySet_New(NULL)) == NULL)
                    goto bad;
                PyObject *item = Py_BuildValue("(OL)", key, (long long)index);
                if (item == NULL || PySet_Add(*failed, item) < 0) {
                    Py_XDECREF(item);
                    goto bad;
                }
                Py_DECREF(item);
            }
            if (version >= 8) {         /* record_errors, then error_message */
                int64_t errors;
                if (pc_count(buf, &pos, end, flexible, 4, &errors))
                    goto bad;
                for (int64_t e = 0; e < errors; e++)
                    if (skip_bytes(&pos, end, 4) || pc_count(buf, &pos, end, flexible, 2, &n)
                            || skip_bytes(&pos, end, n > 0 ? n : 0) || (flexible && pc_tags(buf, &pos, end)))
                        goto bad;
                if (pc_count(buf, &pos, end, flexible, 2, &n) || skip_bytes(&pos, end, n > 0 ? n : 0))
                    goto bad;
            }
            if (flexible && pc_tags(buf, &pos, end))
                goto bad;
        }
        if (flexible && pc_tags(buf, &pos, end))
            goto bad;
    }
    if (version >= 1 && read_be(buf, &pos, end, 4, throttle))
        goto bad;
    Py_XDECREF(key);
    return pos;
bad:
    Py_XDECREF(key);
    if (failed != NULL)
        Py_CLEAR(*failed);
    return -1;
}

PyDoc_STRVAR(produce_answer_doc,
"produce_answer(buf, version) -> ({(topic key, index), ...} | None, throttle_ms) | None\n\n"
"Of a Produce answer from its correlation id on: as kproxy.proxy.produce_bytes.answer_failures.");

static PyObject *produce_answer(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "produce_answer() takes 2 arguments");
        return NULL;
    }
    Py_ssize_t version = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *failed = NULL, *result = NULL;
    int64_t throttle;
    if (pa_walk(view.buf, view.len, version, &failed, &throttle) >= 0)
        result = Py_BuildValue("(OL)", failed ? failed : Py_None, (long long)throttle);
    Py_XDECREF(failed);
    PyBuffer_Release(&view);
    if (result == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return result;
}

/* ---- Fetch under metrics alone: the records fetched, read from a relayed exchange's bytes ----------

   The compiled twin of kproxy/proxy/fetch_bytes.py (the reference and the fallback; a property test
   holds the two equal to the decoder on every Fetch version). Laid out as schema/fetch.kschema:
   flexible from v12, topic ids from v13, node_endpoints (tag 0 of the answer's closing tagged
   fields) from v16. */

static int64_t be64(const uint8_t *p)
{
    return (int64_t)(((uint64_t)be32(p) << 32) | (uint32_t)be32(p + 4));
}

/* Past a tagged-field section; *zero set when it holds tag 0 with anything but an empty compact array. */
static int fc_tags(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, int *zero)
{
    int64_t n, tag, size;
    if (read_uv(buf, pos, end, &n))
        return -1;
    for (int64_t i = 0; i < n; i++) {
        if (read_uv(buf, pos, end, &tag) || read_uv(buf, pos, end, &size) || skip_bytes(pos, end, size))
            return -1;
        if (tag == 0 && zero != NULL && !(size == 1 && buf[*pos - 1] == 1))
            *zero = 1;
    }
    return 0;
}

/* An array that may not be null: its count. */
static int fc_array(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, int flexible, int64_t *n)
{
    return pc_count(buf, pos, end, flexible, 4, n) || *n < 0 ? -1 : 0;
}

/* A topic's key: its id (v13+) or its name (not null), as a span of buf. */
static int fc_key(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, int flexible, int by_id,
                  const uint8_t **key, Py_ssize_t *len)
{
    int64_t n = 16;
    if (!by_id && pc_count(buf, pos, end, flexible, 2, &n))
        return -1;
    if (n < 0 || n > end - *pos)
        return -1;
    *key = buf + *pos;
    *len = (Py_ssize_t)n;
    *pos += (Py_ssize_t)n;
    return 0;
}

typedef struct {
    const uint8_t *key;
    Py_ssize_t len;
    int64_t partition, offset;
} FetchOffset;

/* Each (topic key, partition) of a Fetch request frame and its fetch offset, into a new array (malloc:
   the walk that calls it runs without the GIL in the lane). */
static int fc_offsets(const uint8_t *buf, Py_ssize_t end, Py_ssize_t version, FetchOffset **out, Py_ssize_t *count)
{
    int flexible = version >= 12, by_id = version >= 13;
    Py_ssize_t pos = 10, before = 4 + (version >= 9 ? 4 : 0);
    Py_ssize_t after = (version >= 12 ? 4 : 0) + (version >= 5 ? 8 : 0) + 4;
    int64_t n, topics, partitions;
    FetchOffset *offsets = NULL;
    Py_ssize_t used = 0, size = 0;
    if (end < 10)
        return -1;
    n = (int16_t)(((uint16_t)buf[8] << 8) | buf[9]);
    if (skip_bytes(&pos, end, n > 0 ? n : 0) || (flexible && fc_tags(buf, &pos, end, NULL))
            || skip_bytes(&pos, end, (version <= 14 ? 4 : 0) + 8 + (version >= 3 ? 4 : 0) + (version >= 4 ? 1 : 0)
                          + (version >= 7 ? 8 : 0))
            || fc_array(buf, &pos, end, flexible, &topics))
        return -1;
    for (int64_t t = 0; t < topics; t++) {
        const uint8_t *key;
        Py_ssize_t len;
        if (fc_key(buf, &pos, end, flexible, by_id, &key, &len) || fc_array(buf, &pos, end, flexible, &partitions))
            goto fail;
        for (int64_t i = 0; i < partitions; i++) {
            if (end - pos < before + 8 + after)
                goto fail;
            if (used == size) {
                size = size ? 2 * size : 16;
                FetchOffset *grown = realloc(offsets, (size_t)size * sizeof(FetchOffset));
                if (grown == NULL)
                    goto fail;
                offsets = grown;
            }
            offsets[used].key = key;
            offsets[used].len = len;
            offsets[used].partition = be32(buf + pos);
            offsets[used].offset = be64(buf + pos + before);
            used++;
            pos += before + 8 + after;
            if (flexible && fc_tags(buf, &pos, end, NULL))
                goto fail;
        }
        if (flexible && fc_tags(buf, &pos, end, NULL))
            goto fail;
    }
    *out = offsets;
    *count = used;
    return 0;
fail:
    free(offsets);
    return -1;
}

/* The records of the v2 batches in buf[pos:end] that end at or after from_offset into *total; a partial
   last batch ends the walk; -1 for anything else. */
static int fc_batches(const uint8_t *buf, Py_ssize_t pos, Py_ssize_t end, int64_t from_offset, int64_t *total)
{
    while (end - pos >= 12) {
        int64_t length = be32(buf + pos + 8), count, last;
        if (length < 14)
            return -1;
        if (length > end - pos - 12)
            break;
        if (buf[pos + 16] != 2 || length < 49)
            return -1;
        count = be32(buf + pos + 57);
        if (count < 0 || __builtin_add_overflow(be64(buf + pos), be32(buf + pos + 23), &last))
            return -1;
        if (last >= from_offset)
            *total += count;
        pos += (Py_ssize_t)(12 + length);
    }
    return 0;
}

/* A Fetch answer from its correlation id on: the records fetched into *records (counted only when req,
   the request frame, is given), its throttle time into *throttle, and whether its closing tagged fields
   carry node_endpoints (v16+; an empty array does not count) into *endpoints. 0, or -1 when it cannot
   be read so. Pure C, no Python object: the lane runs it without the GIL (req NULL). */
static int fc_walk(const uint8_t *buf, Py_ssize_t end, Py_ssize_t version, const uint8_t *req, Py_ssize_t req_len,
                   int64_t *records, int64_t *throttle, int *endpoints)
{
    Py_ssize_t pos = 4, asked = -1;
    int flexible = version >= 12, by_id = version >= 13, zero = 0, ok = -1;
    Py_ssize_t fixed = 6 + 8 + (version >= 4 ? 8 : 0) + (version >= 5 ? 8 : 0);
    FetchOffset *offsets = NULL;
    int64_t topics, partitions, n, size;
    *records = *throttle = 0;
    *endpoints = 0;
    if (end < 4 || (flexible && fc_tags(buf, &pos, end, NULL))
            || (version >= 1 && read_be(buf, &pos, end, 4, throttle))
            || (version >= 7 && skip_bytes(&pos, end, 6))
            || fc_array(buf, &pos, end, flexible, &topics))
        goto done;
    for (int64_t t = 0; t < topics; t++) {
        const uint8_t *key;
        Py_ssize_t len;
        if (fc_key(buf, &pos, end, flexible, by_id, &key, &len) || fc_array(buf, &pos, end, flexible, &partitions))
            goto done;
        for (int64_t i = 0; i < partitions; i++) {
            if (fixed > end - pos)
                goto done;
            int64_t partition = be32(buf + pos), error = (int16_t)(((uint16_t)buf[pos + 4] << 8) | buf[pos + 5]);
            pos += fixed;
            if (version >= 4) {         /* aborted_transactions, nullable */
                if (pc_count(buf, &pos, end, flexible, 4, &n) || n < -1)
                    goto done;
                for (int64_t a = 0; a < n; a++)
                    if (skip_bytes(&pos, end, 16) || (flexible && fc_tags(buf, &pos, end, NULL)))
                        goto done;
            }
            if ((version >= 11 && skip_bytes(&pos, end, 4)) || pc_count(buf, &pos, end, flexible, 4, &size)
                    || size < -1 || skip_bytes(&pos, end, size > 0 ? size : 0))
                goto done;
            if (size > 0 && !error && req != NULL) {
                /* the request is read when some partition holds records */
                if (asked < 0 && fc_offsets(req, req_len, version, &offsets, &asked))
                    goto done;
                int64_t from_offset = -1;
                for (Py_ssize_t k = asked - 1; k >= 0; k--) {      /* the last one named, as a dict keeps */
                    if (offsets[k].partition == partition && offsets[k].len == len
                            && memcmp(offsets[k].key, key, (size_t)len) == 0) {
                        from_offset = offsets[k].offset;
                        break;
                    }
                }
                if (fc_batches(buf, pos - (Py_ssize_t)size, pos, from_offset, records))
                    goto done;
            }
            if (flexible && fc_tags(buf, &pos, end, NULL))
                goto done;
        }
        if (flexible && fc_tags(buf, &pos, end, NULL))
            goto done;
    }
    if (flexible && fc_tags(buf, &pos, end, &zero))
        goto done;
    *endpoints = zero && version >= 16;
    ok = 0;
done:
    free(offsets);
    return ok;
}

PyDoc_STRVAR(fetch_counts_doc,
"fetch_counts(request, answer, version) -> (records, throttle_ms, node_endpoints) | None\n\n"
"Of a Fetch request frame (None: records not counted) and its answer: as\n"
"kproxy.proxy.fetch_bytes.py_fetch_counts.");

static PyObject *fetch_counts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fetch_counts() takes 3 arguments");
        return NULL;
    }
    Py_ssize_t version = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view, request = {0};
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (args[0] != Py_None && PyObject_GetBuffer(args[0], &request, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int64_t records, throttle;
    int endpoints;
    PyObject *result = NULL;
    if (fc_walk(view.buf, view.len, version, request.obj != NULL ? request.buf : NULL, request.len, &records,
                &throttle, &endpoints) == 0)
        result = Py_BuildValue("(LLO)", (long long)records, (long long)throttle, endpoints ? Py_True : Py_False);
    if (request.obj != NULL)
        PyBuffer_Release(&request);
    PyBuffer_Release(&view);
    if (result == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return result;
}

/* Whether a Produce answer from its correlation id on carries node_endpoints (tag 0 of the body's
   closing tagged fields, v10+): 1 or 0, -1 when it cannot be walked to the end of those fields. Pure C,
   no Python object: the lane runs it without the GIL (lane_answer_endpoints). */
static int pe_walk(const uint8_t *buf, Py_ssize_t end, Py_ssize_t version)
{
    int64_t throttle, count, tag, size;
    int found = 0;
    Py_ssize_t pos = pa_walk(buf, end, version, NULL, &throttle);
    if (pos >= 0 && version >= 9) {
        if (read_uv(buf, &pos, end, &count))
            return -1;
        for (int64_t i = 0; i < count; i++) {
            if (read_uv(buf, &pos, end, &tag) || read_uv(buf, &pos, end, &size) || skip_bytes(&pos, end, size))
                return -1;
            if (tag == 0 && version >= 10)
                found = 1;
        }
    }
    return pos < 0 ? -1 : found;
}

PyDoc_STRVAR(produce_endpoints_doc,
"produce_endpoints(buf, version) -> bool | None\n\n"
"Whether a Produce answer from its correlation id on carries node_endpoints (tag 0 of the body's\n"
"closing tagged fields, v10+): as kproxy.proxy.produce_bytes.answer_endpoints.");

static PyObject *produce_endpoints(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "produce_endpoints() takes 2 arguments");
        return NULL;
    }
    Py_ssize_t version = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int found = pe_walk(view.buf, view.len, version);
    PyBuffer_Release(&view);
    if (found < 0)
        Py_RETURN_NONE;
    return PyBool_FromLong(found);
}

/* ---- The relay step: a request nothing reads, and its answer nobody reads, in one call each -------

   kproxy/proxy/session.py relays a request that no filter, telemetry or state of the session reads:
   checked whole by the skip programs, its client id learned, its correlation id replaced by kproxy's,
   an InFlight entry made for it; and its answer goes back with the client's correlation id, in
   order. relay_request and relay_answer do those steps of Session.client_frame/_relay/_forwarding and
   Session.upstream_frame/_flush for the common case, reading and writing the session's own
   attributes; anything else (a frame too large to join, Produce counted by metrics, a throttled or
   SASL-reading session, an answer something reads) returns None before changing anything, and the
   session's Python path, the reference, handles it. relay_setup gives them the classes they build. */

static PyObject *R_to_upstream, *R_to_client, *R_forwarded, *R_no_response;
static PyObject *K_sample, *K_telemetry;
static Py_ssize_t relay_requests, relay_answers;

#define NO_LAZY_MIN ((Py_ssize_t)1 << 62)   /* compiler.NO_LAZY: no lazy spans */
#define JOIN_BELOW (16 * 1024)
#define RELAY_BIT (1LL << 32)
#define ANSWER_GUARDS_BIT (1LL << 33)

#define S(name) static PyObject *S_##name;
#define RELAY_NAMES(X) X(_unread_by) X(front) X(_raw_sasl) X(_why_next) X(throttle_until) X(ctx) X(clock) \
    X(client_id) X(requests) X(_next_correlation_id) X(open) X(in_flight) X(_by_upstream) X(_no_response) \
    X(append) X(popleft) X(relayed) X(passes) X(asking) X(request) X(api_key) X(api_version) X(kept_by) \
    X(answered_at) X(upstream_bytes) X(client_correlation_id) X(reply) X(close_after) X(response_bytes) \
    X(_flush) X(may_pass) X(reads_by_bytes) X(reads_answer)
RELAY_NAMES(S)
#undef S

static int relay_names(void)
{
#define I(name) if ((S_##name = PyUnicode_InternFromString(#name)) == NULL) return -1;
    RELAY_NAMES(I)
#undef I
    if ((K_sample = PyLong_FromLong(-2)) == NULL || (K_telemetry = PyLong_FromLong(-1)) == NULL)
        return -1;
    return 0;
}

/* InFlight's slots: an entry is made as a copy of a template entry (attrs' defaults, all constants) with
   the request's own fields set, and read and written at the slots' offsets, as the interpreter's own
   specialised attribute access does; relay_setup checks that every member is an object slot. */
enum { I_client_correlation_id, I_api_key, I_api_version, I_started, I_request, I_upstream_correlation_id,
       I_reply, I_close_after, I_request_bytes, I_response_bytes, I_outcome, I_answered_at, I_seq, I_kept_by,
       I_upstream_bytes, I_relayed, I_throttle_ms, I_produced, I_produce_counts, I_N };
static const char *const I_NAMES[I_N] = {
    "client_correlation_id", "api_key", "api_version", "started", "request", "upstream_correlation_id", "reply",
    "close_after", "request_bytes", "response_bytes", "outcome", "answered_at", "seq", "kept_by",
    "upstream_bytes", "relayed", "throttle_ms", "produced", "produce_counts"};
static Py_ssize_t I_off[I_N];
static PyTypeObject *I_type;
static PyObject *I_template;
static long produce_walked_up_to = -1;
#define ISLOT(o, i) (*(PyObject **)((char *)(o) + I_off[i]))

static void islot_set(PyObject *o, int i, PyObject *v)     /* steals v */
{
    Py_XSETREF(ISLOT(o, i), v);
}

/* A new InFlight: the template's values in every slot. */
static PyObject *inflight_new(void)
{
    PyObject *e = I_type->tp_alloc(I_type, 0);
    if (e == NULL)
        return NULL;
    for (PyMemberDef *m = I_type->tp_members; m->name != NULL; m++)
        *(PyObject **)((char *)e + m->offset) = Py_NewRef(*(PyObject **)((char *)I_template + m->offset));
    return e;
}

PyDoc_STRVAR(relay_setup_doc,
"relay_setup(InFlight, template, ToUpstream, ToClient, FORWARDED, NO_RESPONSE, WALKED_UP_TO)\n\n"
"The classes and outcomes relay_request and relay_answer build with; entries are copies of\n"
"`template` (an InFlight of attrs' defaults, which must all be constants) with their own fields set.\n"
"WALKED_UP_TO: the last Produce version produce_counts reads (produce_bytes.py).");

static PyObject *relay_setup(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7 || !PyType_Check(args[0]) || !Py_IS_TYPE(args[1], (PyTypeObject *)args[0])) {
        PyErr_SetString(PyExc_TypeError, "relay_setup(InFlight, template, ToUpstream, ToClient, FORWARDED, "
                        "NO_RESPONSE, WALKED_UP_TO)");
        return NULL;
    }
    long walked = PyLong_AsLong(args[6]);
    if (walked == -1 && PyErr_Occurred())
        return NULL;
    PyTypeObject *type = (PyTypeObject *)args[0];
    if (type->tp_members == NULL || type->tp_dictoffset != 0) {
        PyErr_SetString(PyExc_TypeError, "InFlight must have __slots__ and no __dict__");
        return NULL;
    }
    for (PyMemberDef *m = type->tp_members; m->name != NULL; m++) {
        if (m->type != T_OBJECT_EX || (m->flags & READONLY)
                || *(PyObject **)((char *)args[1] + m->offset) == NULL) {
            PyErr_Format(PyExc_TypeError, "InFlight.%s is not a set object slot", m->name);
            return NULL;
        }
    }
    for (int i = 0; i < I_N; i++) {
        PyMemberDef *m = type->tp_members;
        while (m->name != NULL && strcmp(m->name, I_NAMES[i]) != 0)
            m++;
        if (m->name == NULL) {
            PyErr_Format(PyExc_TypeError, "InFlight has no slot %s", I_NAMES[i]);
            return NULL;
        }
        I_off[i] = m->offset;
    }
    Py_INCREF(type);
    Py_XSETREF(I_type, type);
    produce_walked_up_to = walked;
    PyObject **slots[] = {&I_template, &R_to_upstream, &R_to_client, &R_forwarded, &R_no_response};
    for (int i = 0; i < 5; i++) {
        Py_INCREF(args[i + 1]);
        Py_XSETREF(*slots[i], args[i + 1]);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(relay_counts_doc,
"relay_counts() -> (requests, answers)\n\n"
"How many requests and answers the relay step has taken in this process (a path counter).");

static PyObject *relay_counts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module; (void)args; (void)nargs;
    return Py_BuildValue("(nn)", relay_requests, relay_answers);
}

static inline int32_t rd32(const uint8_t *p)
{
    return (int32_t)(((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3]);
}

static inline int16_t rd16(const uint8_t *p)
{
    return (int16_t)(((uint16_t)p[0] << 8) | p[1]);
}

static inline void wr32(uint8_t *p, int32_t v)
{
    uint32_t u = (uint32_t)v;
    p[0] = (uint8_t)(u >> 24); p[1] = (uint8_t)(u >> 16); p[2] = (uint8_t)(u >> 8); p[3] = (uint8_t)u;
}

/* 1 when every filter of `guards` (a tuple) passes api_key/version now, 0 when one does not, -1 on error. */
static int all_pass(PyObject *guards, PyObject *key, PyObject *version)
{
    if (!PyTuple_Check(guards))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(guards); i++) {
        PyObject *call[3] = {PyTuple_GET_ITEM(guards, i), key, version};
        PyObject *r = PyObject_VectorcallMethod(S_passes, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (r == NULL)
            return -1;
        int ok = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (ok <= 0)
            return ok;
    }
    return 1;
}

/* Session._guarded's answer for an entry nothing kept anything for: 0 when a filter of `guards` (a
   tuple) reads this answer (one that may_pass does not pass the api version now, or one that reads
   the api's answers by their bytes says this one needs it: a Produce answer with node_endpoints),
   1 when none does, -1 on error. */
static int answer_unguarded(PyObject *guards, PyObject *key, PyObject *version, PyObject *frame)
{
    if (!PyTuple_Check(guards))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(guards); i++) {
        PyObject *f = PyTuple_GET_ITEM(guards, i);
        PyObject *a = PyObject_GetAttr(f, S_may_pass);
        if (a == NULL)
            return -1;
        int may_pass = PyObject_IsTrue(a);
        Py_DECREF(a);
        if (may_pass < 0)
            return -1;
        if (may_pass) {
            PyObject *call[3] = {f, key, version};
            PyObject *r = PyObject_VectorcallMethod(S_passes, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            if (r == NULL)
                return -1;
            int ok = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (ok <= 0)
                return ok;
        }
        PyObject *by_bytes = PyObject_GetAttr(f, S_reads_by_bytes);
        if (by_bytes == NULL)
            return -1;
        int reads = PySequence_Contains(by_bytes, key);
        Py_DECREF(by_bytes);
        if (reads < 0)
            return -1;
        if (reads) {
            PyObject *call[4] = {f, key, version, frame};
            PyObject *r = PyObject_VectorcallMethod(S_reads_answer, call, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            if (r == NULL)
                return -1;
            int needs = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (needs != 0)
                return needs < 0 ? -1 : 0;
        }
    }
    return 1;
}

/* A new reference to attribute `name`, or NULL with an exception. */
#define GET(var, obj, name) do { if ((var = PyObject_GetAttr(obj, S_##name)) == NULL) goto done; } while (0)

PyDoc_STRVAR(relay_request_doc,
"relay_request(session, frame) -> [ToUpstream] | None\n\n"
"Session.client_frame's relay of a request nothing reads, in one call: None (nothing changed) when\n"
"the frame is not for it; the Python path then decides.");

static PyObject *relay_request(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "relay_request() takes 2 arguments");
        return NULL;
    }
    if (I_type == NULL)
        Py_RETURN_NONE;
    PyObject *s = args[0], *frame = args[1];
    PyObject *result = NULL, *unread = NULL, *o = NULL, *key = NULL, *version = NULL, *client_id = NULL;
    PyObject *ctx = NULL, *now = NULL, *seq = NULL, *uid_obj = NULL, *entry = NULL, *set = NULL, *out = NULL;
    PyObject *buffers = NULL, *action = NULL, *counted = NULL, *programs = NULL;
    int decline = 1;
    Py_buffer view = {0};
    GET(unread, s, _unread_by);
    if (!PyDict_CheckExact(unread))
        goto done;
    int has = PyDict_Contains(unread, K_sample);
    if (has != 0) {
        decline = has > 0;
        goto done;
    }
    GET(o, s, front);
    if (o != Py_None)
        goto done;
    Py_CLEAR(o);
    GET(o, s, _raw_sasl);
    if (o != Py_False)
        goto done;
    Py_CLEAR(o);
    GET(o, s, _why_next);
    if (o != Py_None)
        goto done;
    Py_CLEAR(o);
    GET(o, s, throttle_until);
    if (!PyFloat_CheckExact(o) || PyFloat_AS_DOUBLE(o) != 0.0)
        goto done;          /* throttled now or lately: the Python path holds or clears it */
    Py_CLEAR(o);
    if (PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE) < 0) {
        decline = 0;
        goto done;
    }
    const uint8_t *b = view.buf;
    Py_ssize_t end = view.len;
    if (end < 8 || end >= JOIN_BELOW)
        goto done;
    int api_key = rd16(b), api_version = rd16(b + 2);
    int32_t correlation_id = rd32(b + 4);
    o = PyLong_FromLongLong(RELAY_BIT | ((long long)api_key << 16) | (long long)api_version);
    if (o == NULL) {
        decline = 0;
        goto done;
    }
    programs = Py_XNewRef(PyDict_GetItemWithError(unread, o));   /* held: a filter's passes runs below */
    Py_CLEAR(o);
    if (programs == NULL) {
        decline = PyErr_Occurred() == NULL;
        goto done;      /* not worked out yet (``_relayable``): the Python path does it */
    }
    if (!PyTuple_CheckExact(programs) || PyTuple_GET_SIZE(programs) != 3
            || !PyObject_TypeCheck(PyTuple_GET_ITEM(programs, 0), &ProgramType)
            || !PyObject_TypeCheck(PyTuple_GET_ITEM(programs, 1), &ProgramType))
        goto done;
    if ((key = PyLong_FromLong(api_key)) == NULL || (version = PyLong_FromLong(api_version)) == NULL) {
        decline = 0;
        goto done;
    }
    int passing = all_pass(PyTuple_GET_ITEM(programs, 2), key, version);
    if (passing <= 0) {
        decline = passing == 0;
        goto done;
    }
    Ctx hc = {b, (const ProgramObject *)PyTuple_GET_ITEM(programs, 0), NULL, NO_LAZY_MIN};
    Py_ssize_t pos = run(&hc, 0, 0, end, 1, 0);
    if (pos >= 0) {
        Ctx bc = {b, (const ProgramObject *)PyTuple_GET_ITEM(programs, 1), NULL, NO_LAZY_MIN};
        if (run(&bc, 0, pos, end, 1, 0) < 0)
            pos = -1;
    }
    if (pos < 0) {
        if (PyErr_Occurred())
            decline = 0;
        goto done;      /* invalid: the Python path decodes it and says why */
    }
    int no_response = 0;
    has = api_key == 0 ? PyDict_Contains(unread, K_telemetry) : 0;
    if (has < 0) {
        decline = 0;
        goto done;
    }
    if (has) {
        /* Produce, and metrics count its records: read from its batch headers as it goes. */
        if (api_version > produce_walked_up_to)
            goto done;
        PyObject *at = PyLong_FromSsize_t(pos);
        if (at == NULL) {
            decline = 0;
            goto done;
        }
        PyObject *call[3] = {frame, at, version};
        counted = produce_counts(NULL, call, 3);
        Py_DECREF(at);
        if (counted == NULL) {
            decline = 0;
            goto done;
        }
        if (!PyTuple_CheckExact(counted) || PyTuple_GET_SIZE(counted) != 3)
            goto done;      /* None: it cannot say (a legacy message set...): decoded */
        long acks = PyLong_AsLong(PyTuple_GET_ITEM(counted, 0));
        if (acks == -1 && PyErr_Occurred()) {
            decline = 0;
            goto done;
        }
        no_response = acks == 0;
    } else if (api_key == 0) {         /* Produce: acks=0 is owed no answer */
        Py_ssize_t at = pos;
        if (api_version >= 9) {
            int64_t length;
            if (read_uv(b, &at, end, &length))
                goto done;
            at += length ? (Py_ssize_t)length - 1 : 0;
        } else if (api_version >= 3) {
            if (end - at < 2)
                goto done;
            int n = rd16(b + at);
            at += 2 + (n > 0 ? n : 0);
        }
        if (at < 0 || end - at < 2)
            goto done;
        no_response = rd16(b + at) == 0;
    }
    int n = rd16(b + 8);        /* the client id, in every header version past 0 */
    if (n >= 0) {
        if (10 + n > end)
            goto done;
        if ((client_id = PyUnicode_DecodeUTF8((const char *)b + 10, n, "surrogateescape")) == NULL) {
            decline = 0;
            goto done;
        }
    }
    /* From here on the request is relayed: nothing declines. */
    decline = 0;
    GET(ctx, s, ctx);
    GET(o, ctx, clock);
    if ((now = PyObject_CallNoArgs(o)) == NULL)
        goto done;
    Py_CLEAR(o);
    if (client_id != NULL && PyObject_SetAttr(ctx, S_client_id, client_id) < 0)
        goto done;
    GET(o, s, requests);
    long requests = PyLong_AsLong(o);
    if ((requests == -1 && PyErr_Occurred()) || (seq = PyLong_FromLong(requests + 1)) == NULL
            || PyObject_SetAttr(s, S_requests, seq) < 0)
        goto done;
    Py_CLEAR(o);
    GET(uid_obj, s, _next_correlation_id);
    long upstream_id = PyLong_AsLong(uid_obj);
    if (upstream_id == -1 && PyErr_Occurred())
        goto done;
    if ((o = PyLong_FromLong((upstream_id + 1) & 0x7FFFFFFF)) == NULL
            || PyObject_SetAttr(s, S__next_correlation_id, o) < 0)
        goto done;
    Py_CLEAR(o);
    {
        PyObject *cid = PyLong_FromLong(correlation_id), *size = PyLong_FromSsize_t(end + 4);
        if (cid == NULL || size == NULL || (entry = inflight_new()) == NULL) {
            Py_XDECREF(cid);
            Py_XDECREF(size);
            goto done;
        }
        islot_set(entry, I_client_correlation_id, cid);
        islot_set(entry, I_api_key, Py_NewRef(key));
        islot_set(entry, I_api_version, Py_NewRef(version));
        islot_set(entry, I_started, Py_NewRef(now));
        islot_set(entry, I_request_bytes, size);
        islot_set(entry, I_seq, Py_NewRef(seq));
        islot_set(entry, I_relayed, Py_NewRef(frame));
        if (counted != NULL && counted != Py_None) {
            islot_set(entry, I_produced, Py_NewRef(PyTuple_GET_ITEM(counted, 1)));
            islot_set(entry, I_produce_counts, Py_NewRef(PyTuple_GET_ITEM(counted, 2)));
        }
        if (no_response)
            islot_set(entry, I_outcome, Py_NewRef(R_no_response));
        else
            islot_set(entry, I_upstream_correlation_id, Py_NewRef(uid_obj));
    }
    GET(set, s, open);
    if (PySet_Add(set, entry) < 0)
        goto done;
    Py_CLEAR(set);
    if (no_response) {
        /* acks=0: nothing waits for an answer; one that comes anyway (tansu 0.6) is dropped by id. */
        GET(o, s, _no_response);
        PyObject *r = PyObject_CallMethodOneArg(o, S_append, uid_obj);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    } else {
        GET(o, s, in_flight);
        PyObject *r = PyObject_CallMethodOneArg(o, S_append, entry);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
        Py_CLEAR(o);
        GET(o, s, _by_upstream);
        if (PyDict_SetItem(o, uid_obj, entry) < 0)
            goto done;
    }
    Py_CLEAR(o);
    if ((out = PyBytes_FromStringAndSize(NULL, end + 4)) == NULL)
        goto done;
    uint8_t *w = (uint8_t *)PyBytes_AS_STRING(out);
    wr32(w, (int32_t)end);
    memcpy(w + 4, b, 4);
    wr32(w + 8, (int32_t)upstream_id);
    memcpy(w + 12, b + 8, end - 8);
    if ((buffers = PyList_New(1)) == NULL)
        goto done;
    PyList_SET_ITEM(buffers, 0, out);
    out = NULL;
    PyObject *call[2] = {buffers, entry};
    if ((action = PyObject_Vectorcall(R_to_upstream, call, 2, NULL)) == NULL)
        goto done;
    if ((result = PyList_New(1)) == NULL)
        goto done;
    PyList_SET_ITEM(result, 0, action);
    action = NULL;
    relay_requests++;
done:
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    Py_XDECREF(unread); Py_XDECREF(o); Py_XDECREF(key); Py_XDECREF(version); Py_XDECREF(client_id);
    Py_XDECREF(ctx); Py_XDECREF(now); Py_XDECREF(seq); Py_XDECREF(uid_obj); Py_XDECREF(entry);
    Py_XDECREF(set); Py_XDECREF(out); Py_XDECREF(buffers); Py_XDECREF(action); Py_XDECREF(counted);
    Py_XDECREF(programs);
    if (result == NULL && decline && !PyErr_Occurred())
        Py_RETURN_NONE;
    return result;
}

/* Session._flush: answers at the head of the in-order queue that are ready go to the client, each in
   a ToClient completing its entry; a head that closes the connection is left to the Python flush. */
static PyObject *relay_flush(PyObject *s)
{
    PyObject *q = PyObject_GetAttr(s, S_in_flight);
    if (q == NULL)
        return NULL;
    PyObject *out = PyList_New(0), *head = NULL, *reply = NULL, *o = NULL;
    if (out == NULL)
        goto fail;
    for (;;) {
        Py_ssize_t len = PyObject_Length(q);
        if (len < 0)
            goto fail;
        if (len == 0)
            break;
        if ((head = PySequence_GetItem(q, 0)) == NULL)
            goto fail;
        if (!Py_IS_TYPE(head, I_type) || ISLOT(head, I_close_after) != Py_None) {
            /* Not an entry, or closing after it: the Python flush does the rest as it always has. */
            if ((o = PyObject_CallMethodNoArgs(s, S__flush)) == NULL || PyList_SetSlice(out, PY_SSIZE_T_MAX,
                                                                                         PY_SSIZE_T_MAX, o) < 0)
                goto fail;
            break;
        }
        reply = Py_NewRef(ISLOT(head, I_reply));
        if (reply == Py_None)
            break;
        if ((o = PyObject_CallMethodNoArgs(q, S_popleft)) == NULL)
            goto fail;
        Py_CLEAR(o);
        /* Encoded frames start with their 4-byte size prefix. */
        Py_ssize_t n = PyObject_Length(reply);
        if (n < 0)
            goto fail;
        long size = 0;
        if (n > 0) {
            PyObject *first = PySequence_GetItem(reply, 0);
            if (first == NULL)
                goto fail;
            Py_buffer v;
            int bad = PyObject_GetBuffer(first, &v, PyBUF_SIMPLE);
            Py_DECREF(first);
            if (bad < 0)
                goto fail;
            if (v.len < 4) {
                PyBuffer_Release(&v);
                PyErr_SetString(PyExc_ValueError, "an answer shorter than its size prefix");
                goto fail;
            }
            size = (long)rd32(v.buf) + 4;
            PyBuffer_Release(&v);
        }
        if ((o = PyLong_FromLong(size)) == NULL)
            goto fail;
        islot_set(head, I_response_bytes, o);
        o = NULL;
        PyObject *done = PyTuple_Pack(1, head);
        if (done == NULL)
            goto fail;
        PyObject *call[2] = {reply, done};
        o = PyObject_Vectorcall(R_to_client, call, 2, NULL);
        Py_DECREF(done);
        if (o == NULL || PyList_Append(out, o) < 0)
            goto fail;
        Py_CLEAR(o);
        Py_CLEAR(head);
        Py_CLEAR(reply);
    }
    Py_XDECREF(head);
    Py_XDECREF(reply);
    Py_XDECREF(o);
    Py_DECREF(q);
    return out;
fail:
    Py_XDECREF(head); Py_XDECREF(reply); Py_XDECREF(o); Py_XDECREF(out);
    Py_DECREF(q);
    return NULL;
}

PyDoc_STRVAR(relay_answer_doc,
"relay_answer(session, frame) -> [ToClient, ...] | None\n\n"
"Session.upstream_frame's relay of an answer nobody reads to a relayed request, and the in-order\n"
"flush behind it, in one call: None (nothing changed) when the answer is not for it.");

static PyObject *relay_answer(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "relay_answer() takes 2 arguments");
        return NULL;
    }
    if (I_type == NULL)
        Py_RETURN_NONE;
    PyObject *s = args[0], *frame = args[1];
    PyObject *result = NULL, *unread = NULL, *o = NULL, *by = NULL, *uid = NULL, *key = NULL, *version = NULL;
    PyObject *ctx = NULL, *now = NULL, *reply = NULL, *buffers = NULL, *entry = NULL;
    Py_buffer view = {0};
    GET(unread, s, _unread_by);
    if (!PyDict_CheckExact(unread))
        goto done;
    GET(o, s, _raw_sasl);
    if (o != Py_False)
        goto done;
    Py_CLEAR(o);
    GET(o, s, asking);
    if (o != Py_None)
        goto done;      /* an answer may be to kproxy's own question */
    Py_CLEAR(o);
    if (PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE) < 0)
        goto done;
    const uint8_t *b = view.buf;
    Py_ssize_t end = view.len;
    if (end < 4 || end >= JOIN_BELOW)
        goto done;
    GET(by, s, _by_upstream);
    if (!PyDict_CheckExact(by) || (uid = PyLong_FromLong(rd32(b))) == NULL)
        goto done;
    entry = PyDict_GetItemWithError(by, uid);
    if (entry == NULL)
        goto done;      /* unknown, or an acks=0 Produce's: the Python path says which */
    Py_INCREF(entry);   /* the dict lets go of it when it is popped */
    if (!Py_IS_TYPE(entry, I_type) || ISLOT(entry, I_request) != Py_None || ISLOT(entry, I_relayed) == Py_None)
        goto done;
    key = Py_NewRef(ISLOT(entry, I_api_key));
    version = Py_NewRef(ISLOT(entry, I_api_version));
    long k = PyLong_AsLong(key), v = PyLong_AsLong(version);
    if (PyErr_Occurred() || k == 3 || k == 75)
        goto done;    /* Metadata, DescribeTopicPartitions: topic names are learned from them */
    if ((o = PyLong_FromLongLong(((long long)k << 16) | v)) == NULL)
        goto done;
    PyObject *unread_v = PyDict_GetItemWithError(unread, o);       /* borrowed */
    Py_CLEAR(o);
    /* True: nobody reads it; 4 or 5: metrics read the broker's throttle time there (session.py's
       _throttle_at, _note_throttle); anything else (read, a Produce answer's records): Python. */
    long throttle_at = unread_v == Py_True ? 0 : (unread_v != NULL && PyLong_CheckExact(unread_v)) ? PyLong_AsLong(unread_v) : -1;
    if (throttle_at != 0 && throttle_at != 4 && (throttle_at != 5 || end < 5 || b[4] != 0)) {
        PyErr_Clear();
        goto done;      /* (5 with tagged fields in the header: skipped by the Python path) */
    }
    if ((o = PyLong_FromLongLong(ANSWER_GUARDS_BIT | ((long long)k << 16) | v)) == NULL)
        goto done;
    PyObject *guards = PyDict_GetItemWithError(unread, o);         /* borrowed */
    Py_CLEAR(o);
    if (guards == NULL)
        goto done;
    if (guards != Py_None && !(PyTuple_Check(guards) && PyTuple_GET_SIZE(guards) == 0)) {
        if (ISLOT(entry, I_kept_by) != Py_None)
            goto done;    /* a filter kept something for the request: it reads the answer */
        Py_INCREF(guards);      /* a filter's passes and reads_answer run Python code */
        int passing = answer_unguarded(guards, key, version, frame);
        Py_DECREF(guards);
        if (passing <= 0)
            goto done;
    }
    /* From here on the answer is relayed. */
    if (PyDict_DelItem(by, uid) < 0)
        goto done;
    GET(ctx, s, ctx);
    GET(o, ctx, clock);
    if ((now = PyObject_CallNoArgs(o)) == NULL)
        goto done;
    Py_CLEAR(o);
    islot_set(entry, I_answered_at, Py_NewRef(now));
    if ((o = PyLong_FromSsize_t(end)) == NULL)
        goto done;
    islot_set(entry, I_upstream_bytes, o);
    o = NULL;
    long cid = PyLong_AsLong(ISLOT(entry, I_client_correlation_id));
    if (cid == -1 && PyErr_Occurred())
        goto done;
    if ((reply = PyBytes_FromStringAndSize(NULL, end + 4)) == NULL)
        goto done;
    uint8_t *w = (uint8_t *)PyBytes_AS_STRING(reply);
    wr32(w, (int32_t)end);
    wr32(w + 4, (int32_t)cid);
    memcpy(w + 8, b + 4, end - 4);
    if ((buffers = PyList_New(1)) == NULL)
        goto done;
    PyList_SET_ITEM(buffers, 0, reply);
    reply = NULL;
    islot_set(entry, I_reply, buffers);
    buffers = NULL;
    if (throttle_at && end - throttle_at >= 4) {
        /* Too short to say: the client gets the broker's bytes as they are, with no throttle noted. */
        if ((o = PyLong_FromLong(rd32(b + throttle_at))) == NULL)
            goto done;
        islot_set(entry, I_throttle_ms, o);
        o = NULL;
    }
    result = relay_flush(s);
    if (result != NULL)
        relay_answers++;
done:
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    Py_XDECREF(unread); Py_XDECREF(o); Py_XDECREF(by); Py_XDECREF(uid); Py_XDECREF(key); Py_XDECREF(version);
    Py_XDECREF(ctx); Py_XDECREF(now); Py_XDECREF(reply); Py_XDECREF(buffers); Py_XDECREF(entry);
    if (result == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return result;
}
#undef GET

/* ---- FrameReader.next_frame's common case --------------------------------------------------------

   kproxy/protocol/framing.py's FrameReader.next_frame, the reference, for a frame wholly in the receive
   chunk (lent as a view of it) or a chunk that holds no complete frame yet: the same reads and writes
   of the reader's attributes. Every other case (a frame with a buffer of its own, one streaming, a
   bad size prefix, a frame straddling the chunk's end, a small frame copied out of a streaming
   chunk, a subclass) calls the Python method before anything is changed. FrameReader has __slots__:
   its attributes are read and written at their slots' offsets, as the interpreter's own specialised
   attribute access does (the member descriptors' offsets, checked in frames_setup). */

static PyObject *F_streams, *F_python, *F_new_chunk;
static PyTypeObject *F_type;
static Py_ssize_t frames_native;

enum { F_streaming_left, F__ready, F__big, F__buf, F__start, F__end, F_max_frame_size, F_frames, F__hot,
       F__reusable, F__lent, F_NSLOTS };
static const char *const F_SLOT_NAMES[F_NSLOTS] = {"streaming_left", "_ready", "_big", "_buf", "_start", "_end",
                                                   "max_frame_size", "frames", "_hot", "_reusable", "_lent"};
static Py_ssize_t F_off[F_NSLOTS];
#define SLOT(o, i) (*(PyObject **)((char *)(o) + F_off[i]))

#define COPY_MAX (64 * 1024)                /* framing.COPY_MAX */
#define STREAM_CHUNK_SIZE (1024 * 1024)     /* framing.STREAM_CHUNK_SIZE */

PyDoc_STRVAR(frames_setup_doc,
"frames_setup(FrameReader, STREAMS, COPY_MAX, STREAM_CHUNK_SIZE)\n\n"
"framing.py's reader class (its next_frame the reference, called for every case but the common\n"
"two; its slots read at their offsets) and sentinel; the sizes are checked against the ones compiled in.");

static PyObject *frames_setup(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "frames_setup(FrameReader, STREAMS, COPY_MAX, STREAM_CHUNK_SIZE)");
        return NULL;
    }
    if (PyLong_AsSsize_t(args[2]) != COPY_MAX || PyLong_AsSsize_t(args[3]) != STREAM_CHUNK_SIZE) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "framing.py's sizes are not the accelerator's: rebuild it");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)args[0];
    for (int i = 0; i < F_NSLOTS; i++) {
        PyObject *d = PyDict_GetItemString(type->tp_dict, F_SLOT_NAMES[i]);      /* borrowed */
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)
                || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX
                || (((PyMemberDescrObject *)d)->d_member->flags & READONLY)) {
            PyErr_Format(PyExc_TypeError, "FrameReader.%s is not a slot", F_SLOT_NAMES[i]);
            return NULL;
        }
        F_off[i] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    PyObject *method = PyObject_GetAttrString(args[0], "next_frame");
    if (method == NULL)
        return NULL;
    Py_XSETREF(F_python, method);
    if (F_new_chunk == NULL && (F_new_chunk = PyUnicode_InternFromString("_new_chunk")) == NULL)
        return NULL;
    Py_INCREF(args[1]);
    Py_XSETREF(F_streams, args[1]);
    Py_INCREF(type);
    Py_XSETREF(F_type, type);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(frame_counts_doc,
"frame_counts() -> int\n\nFrames next_frame has returned without the Python method (a path counter).");

static PyObject *frame_counts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module; (void)args; (void)nargs;
    return PyLong_FromSsize_t(frames_native);
}

/* A slot holding a non-negative int that fits: its value, else -1. */
static inline Py_ssize_t slot_int(PyObject *o, int i)
{
    PyObject *v = SLOT(o, i);
    if (v == NULL || !PyLong_CheckExact(v))
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    if (n < 0) {
        PyErr_Clear();
        return -1;
    }
    return n;
}

static inline void slot_set(PyObject *o, int i, PyObject *v)     /* steals v */
{
    Py_XSETREF(SLOT(o, i), v);
}

PyDoc_STRVAR(next_frame_doc,
"next_frame(reader, stream_from) -> memoryview | None\n\n"
"FrameReader.next_frame(reader, stream_from), the common cases compiled.");

static PyObject *next_frame(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "next_frame() takes 2 arguments");
        return NULL;
    }
    if (F_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "frames_setup() was not called");
        return NULL;
    }
    PyObject *r = args[0];
    Py_ssize_t stream_from = PyLong_AsSsize_t(args[1]);
    if (stream_from == -1 && PyErr_Occurred())
        return NULL;
    if (!Py_IS_TYPE(r, F_type) || slot_int(r, F_streaming_left) != 0
            || SLOT(r, F__ready) != Py_None || SLOT(r, F__big) != Py_None)
        goto python;
    PyObject *buf = SLOT(r, F__buf);
    if (buf == Py_None)
        Py_RETURN_NONE;
    if (buf == NULL || !PyByteArray_CheckExact(buf))
        goto python;
    Py_ssize_t start = slot_int(r, F__start), end = slot_int(r, F__end), max = slot_int(r, F_max_frame_size);
    Py_ssize_t frames = slot_int(r, F_frames), blen = PyByteArray_GET_SIZE(buf);
    if (start < 0 || end < start || end > blen || max < 0 || frames < 0)
        goto python;
    if (end - start < 4)
        Py_RETURN_NONE;
    int32_t size = rd32((const uint8_t *)PyByteArray_AS_STRING(buf) + start);
    if (stream_from && size >= stream_from)
        return Py_NewRef(F_streams);
    if (size < 0 || size > max)
        goto python;        /* the Python method raises FrameError with its reason */
    Py_ssize_t next = start + 4 + size;
    if (next > end) {
        if (next <= blen)
            Py_RETURN_NONE;     /* fits in the current chunk: keep receiving into it */
        goto python;            /* a fresh chunk or a buffer of its own */
    }
    if (size <= COPY_MAX && blen == STREAM_CHUNK_SIZE)
        goto python;        /* maybe copied out of a streaming chunk */
    PyObject *mv = PyMemoryView_FromObject(buf);
    if (mv == NULL)
        return NULL;
    PyObject *frame = PySequence_GetSlice(mv, start + 4, next);
    Py_DECREF(mv);
    if (frame == NULL)
        return NULL;
    PyObject *v_next = PyLong_FromSsize_t(next), *v_frames = PyLong_FromSsize_t(frames + 1);
    if (v_next == NULL || v_frames == NULL) {
        Py_XDECREF(v_next);
        Py_XDECREF(v_frames);
        Py_DECREF(frame);
        return NULL;
    }
    slot_set(r, F__start, v_next);
    slot_set(r, F_frames, v_frames);
    slot_set(r, F__hot, Py_NewRef(Py_False));
    slot_set(r, F__reusable, Py_NewRef(Py_False));   /* the frame is a view of the chunk */
    slot_set(r, F__lent, Py_NewRef(Py_True));
    if (next == end && end > blen / 2) {
        /* Everything consumed and the chunk half used: the next frame starts on a fresh chunk. */
        PyObject *call[2] = {r, end == blen ? Py_True : Py_False};
        PyObject *done = PyObject_VectorcallMethod(F_new_chunk, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (done == NULL) {
            Py_DECREF(frame);
            return NULL;
        }
        Py_DECREF(done);
    }
    frames_native++;
    return frame;
python:
    return PyObject_CallFunctionObjArgs(F_python, r, args[1], NULL);
}

static PyMethodDef methods[] = {
    {"skip", (PyCFunction)(void (*)(void))skip, METH_FASTCALL, skip_doc},
    {"produce_counts", (PyCFunction)(void (*)(void))produce_counts, METH_FASTCALL, produce_counts_doc},
    {"produce_answer", (PyCFunction)(void (*)(void))produce_answer, METH_FASTCALL, produce_answer_doc},
    {"produce_endpoints", (PyCFunction)(void (*)(void))produce_endpoints, METH_FASTCALL, produce_endpoints_doc},
    {"fetch_counts", (PyCFunction)(void (*)(void))fetch_counts, METH_FASTCALL, fetch_counts_doc},
    {"split_records", (PyCFunction)(void (*)(void))split_records, METH_FASTCALL, split_records_doc},
    {"join_records", (PyCFunction)(void (*)(void))join_records, METH_FASTCALL, join_records_doc},
    {"seal_records", (PyCFunction)(void (*)(void))seal_records, METH_FASTCALL, seal_records_doc},
    {"open_records", (PyCFunction)(void (*)(void))open_records, METH_FASTCALL, open_records_doc},
    {"relay_setup", (PyCFunction)(void (*)(void))relay_setup, METH_FASTCALL, relay_setup_doc},
    {"relay_request", (PyCFunction)(void (*)(void))relay_request, METH_FASTCALL, relay_request_doc},
    {"relay_answer", (PyCFunction)(void (*)(void))relay_answer, METH_FASTCALL, relay_answer_doc},
    {"relay_counts", (PyCFunction)(void (*)(void))relay_counts, METH_FASTCALL, relay_counts_doc},
    {"frames_setup", (PyCFunction)(void (*)(void))frames_setup, METH_FASTCALL, frames_setup_doc},
    {"next_frame", (PyCFunction)(void (*)(void))next_frame, METH_FASTCALL, next_frame_doc},
    {"frame_counts", (PyCFunction)(void (*)(void))frame_counts, METH_FASTCALL, frame_counts_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kproxy.protocol._accel",
    .m_doc = "Native validating skip for kproxy's generated codecs (optional; see compiler.py).",
    .m_size = -1,
    .m_methods = methods,
};

/* ---- The check engine for kproxy/server/_lane.c, as a capsule (_accel._C_API) -----------------------

   The lane relays requests in a thread without the GIL, with the very check Session._relay runs:
   run() over the header program, then the body program from where the header ends; and, for answers the
   address rewriter reads by their bytes, the walk that says whether one carries node_endpoints. run() touches no
   Python object when it is given no spans dict (spans is the only Python it reaches, on every path,
   errors included), so lane_check is safe without the GIL as long as the caller holds references to
   both programs (a Program's ops never change after program_new). _lane.c declares the same struct
   and refuses a capsule whose abi or size differ. */

typedef struct {
    int abi;                        /* LANE_CAPI_ABI */
    size_t size;                    /* sizeof this struct */
    PyTypeObject *program_type;
    Py_ssize_t (*check)(PyObject *header, PyObject *body, const uint8_t *frame, Py_ssize_t len);
    int (*answer_endpoints)(int api_key, int version, const uint8_t *frame, Py_ssize_t len);
} AccelLaneAPI;
#define LANE_CAPI_ABI 2

/* The body's start when `frame` (a request without its size prefix) passes both programs, else -1. */
static Py_ssize_t lane_check(PyObject *header, PyObject *body, const uint8_t *frame, Py_ssize_t len)
{
    Ctx hc = {frame, (const ProgramObject *)header, NULL, NO_LAZY_MIN};
    Py_ssize_t pos = run(&hc, 0, 0, len, 1, 0);
    if (pos < 0)
        return -1;
    Ctx bc = {frame, (const ProgramObject *)body, NULL, NO_LAZY_MIN};
    return run(&bc, 0, pos, len, 1, 0) < 0 ? -1 : pos;
}

/* Whether an answer (from its correlation id on) of Produce v10+ or Fetch v16+ carries node_endpoints,
   which the address rewriter must rewrite: 1, 0, or -1 when it cannot be walked (or is of another api).
   The same walks as produce_endpoints and fetch_counts, the address rewriter's reads_answer. */
static int lane_answer_endpoints(int api_key, int version, const uint8_t *frame, Py_ssize_t len)
{
    if (api_key == 0)
        return pe_walk(frame, len, version);
    if (api_key == 1) {
        int64_t records, throttle;
        int endpoints;
        return fc_walk(frame, len, version, NULL, 0, &records, &throttle, &endpoints) < 0 ? -1 : endpoints;
    }
    return -1;
}

static AccelLaneAPI lane_api = {LANE_CAPI_ABI, sizeof(AccelLaneAPI), &ProgramType, lane_check,
                                lane_answer_endpoints};

static int add_lane_api(PyObject *m)
{
    PyObject *capsule = PyCapsule_New(&lane_api, "kproxy.protocol._accel._C_API", NULL);
    if (capsule == NULL)
        return -1;
    int err = PyModule_AddObject(m, "_C_API", capsule);
    if (err < 0)
        Py_DECREF(capsule);
    return err;
}

PyMODINIT_FUNC PyInit__accel(void)
{
    if (PyType_Ready(&ProgramType) < 0 || PyType_Ready(&WindowType) < 0 || PyType_Ready(&DecoderType) < 0
            || relay_names() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ProgramType);
    if (PyModule_AddObject(m, "Program", (PyObject *)&ProgramType) < 0
            || PyModule_AddIntConstant(m, "ABI", ABI) < 0
            || PyModule_AddObjectRef(m, "Decoder", (PyObject *)&DecoderType) < 0
            || PyModule_AddIntConstant(m, "DECODER_ABI", DECODER_ABI) < 0
            || PyModule_AddIntConstant(m, "OPEN_INTO", 1) < 0 || add_lane_api(m) < 0) {
        Py_DECREF(&ProgramType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
