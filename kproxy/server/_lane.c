/* The lane: a readiness loop of kproxy's own, in one thread per process that runs without the GIL,
   to which trio hands a plain connection so that small frames are relayed without a task switch each.

   It relays what it may (correlation ids rewritten both ways, answers in order, counted) and gives
   the connection back at a frame boundary the moment anything else happens; kproxy/server/lane.py
   wraps it and says the rules. The lane thread never touches a Python object: the programs it checks
   requests with are read through the accelerator's capsule (_accel._C_API), whose check is GIL-free,
   and so is its walk of the answers that may name a broker (node_endpoints, read before they go on).

   Locking: one mutex per lane. The lane thread holds it while it handles one batch of readiness
   events, commands and timers, and drops it only around epoll_wait; every Python call (adopt, recall,
   take, detach, counts) takes it. So whatever the Python side sees of a connection is between two
   batches.

   No fd is touched after detach or take returns: both remove the fds from the lane's epoll and mark
   the connection given back under the mutex, and the lane does I/O only under the mutex and only on
   a connection still adopted. Events of the current batch that still name a connection given back
   are skipped by that state, and its memory is freed only by the lane between batches (the `dead`
   list), so a stale pointer in a batch is never followed into freed memory. A reused fd number can
   therefore never receive one client's bytes meant for another.

   The answer memo: an answer kproxy rewrites (Metadata names brokers) is never relayed as the broker
   sent it. The Python path remembers each rewrite it makes (kproxy/proxy/memo.py) and puts it in its
   lane's memo too; the lane serves such an answer only from there, by (the class Python gave the
   connection's api version, the broker's bytes after the correlation id), and gives the connection
   back with the answer unread when it is not there. The lane's mutex guards the memo.

   Memory: see IN_START (buffers follow the bytes that arrived) and `held` (the process's buffer
   budget, which pauses client reads). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* Must match the struct of the same name in kproxy/protocol/_accel.c (checked by abi and size). */
typedef struct {
    int abi;
    size_t size;
    PyTypeObject *program_type;
    Py_ssize_t (*check)(PyObject *header, PyObject *body, const uint8_t *frame, Py_ssize_t len);
    int (*answer_endpoints)(int api_key, int version, const uint8_t *frame, Py_ssize_t len);
} AccelLaneAPI;
#define LANE_CAPI_ABI 2

static const AccelLaneAPI *accel;

#define MAX_API 256
#define SAMPLE 64
#define NO_RESPONSE_KEPT 128     /* acks=0 ids remembered for a broker that answers anyway (tansu 0.6) */
#define PRODUCE 0
#define FETCH 1

/* Process totals, for tests: adopted, given back, requests relayed, answers relayed. */
static uint64_t total_adopted, total_given, total_requests, total_answers;

/* Memory. An input buffer starts at IN_START (or what was handed over, plus IN_START) and grows only
   to the frame its size prefix announces, never past max_frame + 4; a buffer grown past IN_START goes
   back to it once it holds little, SHRINK_AFTER_S after it grew (a timer, not every frame: a stream
   of large frames would otherwise realloc twice a frame), once the client has been silent as long. */
#define IN_START 4096
#define SHRINK_AFTER_S 1.0
/* The process's buffer budget (kproxy/server/budget.py): `held` is what every lane of the process
   has allocated for connections (the four buffers' capacity and the requests kept for give-back),
   kept as it changes; each lane gets the budget's limit and the bytes the Python path holds
   (Lane.budget) and reads no client while the sum is at the limit. A paused lane looks again every
   BUDGET_POLL_S: what frees room may be another lane or the Python path, which do not wake it. */
#define BUDGET_POLL_S 0.01
static int64_t held;

static inline void held_add(int64_t delta)
{
    __atomic_add_fetch(&held, delta, __ATOMIC_RELAXED);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
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

/* ---- Per-api counts, drained by Lane.counts() ---------------------------------------------------- */

typedef struct {
    uint64_t count, request_bytes, response_bytes, throttle_ms_sum, throttled, seen;
    double latency_sum;
    int nsample;
    double sample[SAMPLE];
} ApiStats;

/* ---- One connection ----------------------------------------------------------------------------- */

typedef struct {
    int32_t client_cid, up_cid;
    int16_t key, version;
    double t;
    uint8_t *request;       /* the frame as received, without its size prefix (malloc) */
    uint32_t len;
} Entry;

typedef struct {
    int32_t up_cid;
    int16_t key, version;
    double t;
} Unowed;

typedef struct {
    int32_t key_version;    /* api_key << 16 | api_version */
    int throttle_at;
    int walk;               /* the answer is walked for node_endpoints before it is relayed (Produce v10+, Fetch v16+) */
    PyObject *header, *body;
    int remember;           /* the answer goes out only as the memo remembers it (remembered_answer) */
    uint64_t klass;         /* the memo's class for it (lane.py's LaneApi.memo_class) */
} Api;

struct Lane;
struct Conn;

typedef struct {
    uint8_t *buf;
    size_t len, cap;
    struct Conn *conn;      /* whose: growing past IN_START sets its shrink timer (NULL until adopted) */
} Buf;

/* ---- The answer memo (one per lane) -------------------------------------------------------------- */

#define MEMO_BUCKETS 1024               /* a power of 2 */
#define MEMO_MAX_ENTRIES 512            /* the bounds of kproxy/proxy/memo.py's AnswerMemo */
#define MEMO_MAX_BYTES ((size_t)8 << 20)

typedef struct MemoEntry {
    struct MemoEntry *chain;            /* the next in its bucket */
    struct MemoEntry *newer, *older;    /* by last use */
    uint64_t klass, hash;
    uint32_t seen_len, tail_len;
    uint8_t data[];                     /* the broker's bytes after the correlation id, then the client's */
} MemoEntry;

typedef struct {
    MemoEntry *buckets[MEMO_BUCKETS];
    MemoEntry *newest, *oldest;
    size_t entries, bytes;
    uint64_t hits, misses, stored;
} Memo;

typedef struct {
    struct Conn *conn;
    int fd;
    int client;
    uint32_t mask;          /* what epoll waits for now */
} Side;

enum { ADOPTED, GIVEN, DETACHED };

typedef struct Conn {
    struct Lane *lane;
    struct Conn *prev, *next;
    int state;
    int efd;                        /* the eventfd that says "given back" to trio */
    Side cs, bs;
    Api *apis;
    Py_ssize_t napis;
    uint8_t *client_id;             /* NULL: null client id */
    Py_ssize_t client_id_len;
    int32_t next_cid;
    int max_in_flight;
    double request_to, idle_to, frame_to;
    Buf cin, bin, cout, bout;
    Entry *ring;                    /* max_in_flight entries, oldest at head */
    int head, count;
    Unowed unowed[NO_RESPONSE_KEPT];
    int nunowed;
    int recall, want_give, kick;          /* want_give: "frame" at the boundary, once nothing is in flight */
    char reason[24];
    char detail[160];
    double last_rx, partial_since;
    uint64_t requests, bytes_in, bytes_out;
    double given_at;
    double shrink_at;               /* when to shrink buffers grown past IN_START (0: none is) */
    int starved;                    /* not reading the client: the buffer budget is exhausted */
} Conn;

typedef struct Lane {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_t thread;
    int started, stopping, closed;
    int ep, wake;
    Py_ssize_t max_frame, write_limit;
    Conn *conns;                    /* adopted connections */
    Conn *dead;                     /* given back and dropped by Python: freed by the lane thread */
    int kicked;                     /* a connection needs a look without an event (adopt, recall) */
    double next_scan;               /* earliest deadline of any connection (0: none) */
    uint64_t rng;
    ApiStats *stats;                /* MAX_API of them */
    Memo memo;                      /* rewritten answers, under mu */
    int64_t budget_limit;           /* atomic: the buffer budget (-1: none); see `held` */
    int64_t budget_outside;         /* atomic: what the Python path holds of it */
    int starved;                    /* some connection waits for room in the budget */
} Lane;

/* Whether the buffer budget leaves no room: then the lane reads no client. */
static inline int over_budget(const Lane *l)
{
    int64_t limit = __atomic_load_n(&l->budget_limit, __ATOMIC_RELAXED);
    return limit >= 0 && __atomic_load_n(&held, __ATOMIC_RELAXED)
                         + __atomic_load_n(&l->budget_outside, __ATOMIC_RELAXED) >= limit;
}

static void buf_free(Buf *b)
{
    held_add(-(int64_t)b->cap);
    free(b->buf);
    b->buf = NULL;
    b->len = b->cap = 0;
}

static void note_deadline(struct Lane *l, double at);

/* The one place a buffer's capacity changes, counted in `held`; one grown past IN_START is shrunk
   again by the watchdog's scan (a timer here, so that the data path checks nothing for it). */
static int buf_resize(Buf *b, size_t cap)
{
    uint8_t *nb = realloc(b->buf, cap);
    if (nb == NULL)
        return -1;
    held_add((int64_t)cap - (int64_t)b->cap);
    b->buf = nb;
    b->cap = cap;
    if (cap > IN_START && b->conn != NULL && b->conn->shrink_at == 0) {
        b->conn->shrink_at = now_s() + SHRINK_AFTER_S;
        note_deadline(b->conn->lane, b->conn->shrink_at);
    }
    return 0;
}

/* Appends n bytes; cap is a hard bound fixed at adopt (write_limit + max_frame + 4). */
static int buf_put(Buf *b, const uint8_t *p, size_t n, size_t bound)
{
    if (b->len + n > b->cap) {
        size_t want = b->cap ? b->cap : 4096;
        while (want < b->len + n)
            want *= 2;
        if (want > bound)
            want = bound;
        if (b->len + n > want || buf_resize(b, want) < 0)
            return -1;
    }
    memcpy(b->buf + b->len, p, n);
    b->len += n;
    return 0;
}

/* Room for the whole frame at the front of an input buffer, as its size prefix says, within `most`
   (max_frame + 4): 1 when it grew, 0 when it need not or may not (a bad size is the frame loops'
   to refuse), -1 out of memory. */
static int buf_grow(Buf *in, size_t most)
{
    if (in->len < 4)
        return 0;
    int32_t size = rd32(in->buf);
    size_t want = 4 + (size_t)size;
    if (size < 0 || want <= in->cap || want > most)
        return 0;
    return buf_resize(in, want) < 0 ? -1 : 1;
}

/* Back to IN_START once it holds less than half of that: strictly less, so that an input buffer
   keeps room to read into (the loop's masks stop reading a full one). */
static void buf_shrink(Buf *b)
{
    if (b->cap > IN_START && b->len < IN_START / 2)
        buf_resize(b, IN_START);        /* out of memory: kept as it is, the next look tries again */
}

static void buf_drop(Buf *b, size_t n)
{
    if (n >= b->len) {
        b->len = 0;
        return;
    }
    memmove(b->buf, b->buf + n, b->len - n);
    b->len -= n;
}

static void conn_free_raw(Conn *c)
{
    for (int i = 0; i < c->count; i++) {
        Entry *e = &c->ring[(c->head + i) % c->max_in_flight];
        if (e->request != NULL)
            held_add(-(int64_t)e->len);
        free(e->request);
    }
    free(c->ring);
    buf_free(&c->cin); buf_free(&c->bin); buf_free(&c->cout); buf_free(&c->bout);
    free(c->client_id);
    free(c);
}

/* ---- The lane thread's work on one connection (mutex held) --------------------------------------- */

static void set_mask(Conn *c, Side *s, uint32_t mask)
{
    if (s->mask == mask)
        return;
    struct epoll_event ev = {.events = mask, .data.ptr = s};
    epoll_ctl(c->lane->ep, EPOLL_CTL_MOD, s->fd, &ev);
    s->mask = mask;
}

static void unregister(Conn *c)
{
    epoll_ctl(c->lane->ep, EPOLL_CTL_DEL, c->cs.fd, NULL);
    epoll_ctl(c->lane->ep, EPOLL_CTL_DEL, c->bs.fd, NULL);
    Lane *l = c->lane;
    if (c->prev)
        c->prev->next = c->next;
    else
        l->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->prev = c->next = NULL;
}

static void flush_side(Buf *out, int fd)
{
    while (out->len) {
        ssize_t n = send(fd, out->buf, out->len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            buf_drop(out, (size_t)n);
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        return;         /* EAGAIN, or an error the next read reports */
    }
}

static void give_back(Conn *c, const char *reason, const char *detail)
{
    if (c->state != ADOPTED)
        return;
    flush_side(&c->cout, c->cs.fd);
    flush_side(&c->bout, c->bs.fd);
    unregister(c);
    snprintf(c->reason, sizeof c->reason, "%s", reason);
    if (detail != c->detail)
        snprintf(c->detail, sizeof c->detail, "%s", detail);
    c->state = GIVEN;
    c->given_at = now_s();
    __atomic_add_fetch(&total_given, 1, __ATOMIC_RELAXED);
    uint64_t one = 1;
    if (write(c->efd, &one, sizeof one) < 0) {
        /* An eventfd write fails only on overflow, which one write per connection cannot reach. */
    }
}

static void note_deadline(struct Lane *l, double at)
{
    if (at > 0 && (l->next_scan == 0 || at < l->next_scan))
        l->next_scan = at;
}

static const Api *find_api(const Conn *c, int32_t kv)
{
    Py_ssize_t lo = 0, hi = c->napis;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (c->apis[mid].key_version < kv)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < c->napis && c->apis[lo].key_version == kv ? &c->apis[lo] : NULL;
}

/* Kafka's unsigned varint (at most 5 bytes) at *pos, or -1. */
static int read_uv(const uint8_t *b, size_t end, size_t *pos, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift <= 28; shift += 7) {
        if (*pos >= end)
            return -1;
        uint8_t x = b[(*pos)++];
        v |= (uint64_t)(x & 0x7f) << shift;
        if (x < 0x80) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* Session._relay's acks read for Produce: 1 acks=0, 0 otherwise, -1 when it cannot be read (the
   frame is then given back and the Python path decides). */
static int produce_no_response(const uint8_t *b, Py_ssize_t end, Py_ssize_t pos, int version)
{
    Py_ssize_t at = pos;
    if (version >= 9) {
        uint64_t v;
        size_t upos = (size_t)at;
        if (read_uv(b, (size_t)end, &upos, &v))
            return -1;
        at = (Py_ssize_t)upos + (v ? (Py_ssize_t)v - 1 : 0);
    } else if (version >= 3) {
        if (end - at < 2)
            return -1;
        int n = rd16(b + at);
        at += 2 + (n > 0 ? n : 0);
    }
    if (at < 0 || end - at < 2)
        return -1;
    return rd16(b + at) == 0;
}

static void count_answer(Lane *l, int key, uint64_t req_bytes, uint64_t resp_bytes, double latency,
                         int throttle_ms, int has_throttle)
{
    if (key < 0 || key >= MAX_API)
        return;
    ApiStats *s = &l->stats[key];
    s->count++;
    s->request_bytes += req_bytes;
    s->response_bytes += resp_bytes;
    s->latency_sum += latency;
    s->seen++;
    if (s->nsample < SAMPLE) {
        s->sample[s->nsample++] = latency;
    } else {
        /* Reservoir sampling: each latency of the period is kept with the same chance. */
        l->rng ^= l->rng << 13; l->rng ^= l->rng >> 7; l->rng ^= l->rng << 17;
        uint64_t j = l->rng % s->seen;
        if (j < SAMPLE)
            s->sample[j] = latency;
    }
    if (has_throttle) {
        s->throttle_ms_sum += (uint64_t)(throttle_ms > 0 ? throttle_ms : 0);
        if (throttle_ms > 0)
            s->throttled++;
    }
}

/* Relays the whole client frames at the front of cin, as far as the limits allow. */
static void client_frames(Conn *c, double now)
{
    Lane *l = c->lane;
    size_t pos = 0;
    const size_t bound = (size_t)(l->write_limit + l->max_frame + 4);
    while (c->state == ADOPTED && !c->want_give && !c->recall) {
        if (c->count >= c->max_in_flight || c->bout.len >= (size_t)l->write_limit)
            break;
        size_t have = c->cin.len - pos;
        if (have < 4)
            break;
        const uint8_t *p = c->cin.buf + pos;
        int32_t size = rd32(p);
        if (size < 8 || size > l->max_frame) {
            c->want_give = 1;
            snprintf(c->detail, sizeof c->detail, "a request frame of %d bytes (the lane takes 8 to %zd)",
                     (int)size, l->max_frame);
            break;
        }
        if (have - 4 < (size_t)size)
            break;
        const uint8_t *f = p + 4;
        int key = rd16(f), version = rd16(f + 2);
        int32_t cid = rd32(f + 4);
        const Api *api = find_api(c, (int32_t)((uint32_t)(uint16_t)key << 16 | (uint16_t)version));
        if (api == NULL) {
            c->want_give = 1;
            snprintf(c->detail, sizeof c->detail, "api %d v%d is not in the lane's table", key, version);
            break;
        }
        Py_ssize_t body = accel->check(api->header, api->body, f, size);
        if (body < 0) {
            c->want_give = 1;
            snprintf(c->detail, sizeof c->detail, "api %d v%d request fails its check", key, version);
            break;
        }
        int n = rd16(f + 8);    /* the client id, in every header version past 0 */
        int same = n < 0 ? c->client_id == NULL
                         : (10 + n <= size && c->client_id != NULL && c->client_id_len == n
                            && memcmp(c->client_id, f + 10, (size_t)n) == 0);
        if (!same) {
            c->want_give = 1;
            snprintf(c->detail, sizeof c->detail, "api %d v%d request with another client id", key, version);
            break;
        }
        int no_response = 0;
        if (key == PRODUCE) {
            no_response = produce_no_response(f, size, body, version);
            if (no_response < 0) {
                c->want_give = 1;
                snprintf(c->detail, sizeof c->detail, "Produce v%d request whose acks cannot be read", version);
                break;
            }
        }
        int32_t up = c->next_cid;
        uint8_t head[12];
        memcpy(head, p, 8);
        wr32(head + 8, up);
        if (buf_put(&c->bout, head, 12, bound) < 0 || buf_put(&c->bout, f + 8, (size_t)size - 8, bound) < 0) {
            give_back(c, "broker_error", "out of memory queueing a request");
            return;
        }
        c->next_cid = (int32_t)(((uint32_t)up + 1) & 0x7FFFFFFF);
        c->requests++;
        c->bytes_in += (uint64_t)size + 4;
        __atomic_add_fetch(&total_requests, 1, __ATOMIC_RELAXED);
        if (no_response) {
            /* acks=0: nothing waits for an answer (counted as done now); one that comes anyway is
               dropped by its id, as Session does. */
            if (c->nunowed == NO_RESPONSE_KEPT) {
                memmove(c->unowed, c->unowed + 1, sizeof(Unowed) * (NO_RESPONSE_KEPT - 1));
                c->nunowed--;
            }
            c->unowed[c->nunowed++] = (Unowed){up, (int16_t)key, (int16_t)version, now};
            count_answer(l, key, (uint64_t)size + 4, 0, 0.0, 0, 0);
        } else {
            Entry *e = &c->ring[(c->head + c->count) % c->max_in_flight];
            e->request = malloc((size_t)size);
            if (e->request == NULL) {
                give_back(c, "client_error", "out of memory keeping a request");
                return;
            }
            memcpy(e->request, f, (size_t)size);
            held_add(size);
            e->len = (uint32_t)size;
            e->client_cid = cid;
            e->up_cid = up;
            e->key = (int16_t)key;
            e->version = (int16_t)version;
            e->t = now;
            if (c->count++ == 0 && c->request_to > 0)
                note_deadline(l, now + c->request_to);
        }
        pos += 4 + (size_t)size;
    }
    if (pos) {
        buf_drop(&c->cin, pos);
        c->partial_since = c->cin.len ? now : 0;
        if (c->cin.len && c->frame_to > 0)
            note_deadline(l, now + c->frame_to);
    }
}

/* The answer's throttle time at `at` (session.py's _throttle_at: 4 behind the correlation id, 5
   behind header v1's tagged fields, skipped first); 0 when there is none to read. */
static int read_throttle(const uint8_t *f, size_t size, int at, int *ms)
{
    size_t pos = 4;
    if (at == 5) {
        uint64_t n, tag, len;
        if (read_uv(f, size, &pos, &n))
            return 0;
        for (uint64_t i = 0; i < n; i++) {
            if (read_uv(f, size, &pos, &tag) || read_uv(f, size, &pos, &len) || len > size - pos)
                return 0;
            pos += (size_t)len;
        }
    } else if (at != 4) {
        return 0;
    }
    if (pos > size || size - pos < 4)
        return 0;
    *ms = rd32(f + pos);
    return 1;
}

/* Whether an answer (f: from its correlation id on) may be relayed unread: 1, or 0 after giving the
   connection back with that answer first in bin (what came before it is dropped: relayed already). An
   answer that carries node_endpoints (KIP-951: a broker's own address) must be rewritten by Python's
   address rewriter, never relayed raw; one that cannot be walked is decoded there, which says what is
   wrong with it. */
static int answer_walked(Conn *c, const Entry *e, const uint8_t *f, size_t size, size_t pos)
{
    int found = accel->answer_endpoints(e->key, e->version, f, (Py_ssize_t)size);
    if (found == 0)
        return 1;
    char detail[160];
    snprintf(detail, sizeof detail, found > 0 ? "api %d v%d answer carries node_endpoints"
                                              : "api %d v%d answer that cannot be walked", e->key, e->version);
    buf_drop(&c->bin, pos);
    give_back(c, found > 0 ? "endpoints" : "bad_answer", detail);
    return 0;
}

static uint64_t memo_hash(uint64_t klass, const uint8_t *p, size_t n)
{
    /* Not cryptographic: a collision costs a memcmp, never a wrong answer (the bytes are compared). */
    uint64_t h = (klass + 1) * 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
    }
    uint64_t w = 0;
    memcpy(&w, p + i, n - i);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 29);
}

/* Where the entry for (klass, seen) is in its bucket's chain; *result is NULL when there is none.
   For equal bytes memo_hash is a bijection of the class (each step is), so equal hashes and equal
   bytes already mean equal classes: the class comparison never decides, and no test can make it. */
static MemoEntry **memo_slot(Memo *m, uint64_t klass, uint64_t h, const uint8_t *seen, size_t n)
{
    MemoEntry **at = &m->buckets[h & (MEMO_BUCKETS - 1)];
    for (; *at != NULL; at = &(*at)->chain) {
        MemoEntry *e = *at;
        if (e->hash == h && e->klass == klass && e->seen_len == n && memcmp(e->data, seen, n) == 0)
            break;
    }
    return at;
}

static void memo_unlink(Memo *m, MemoEntry *e)
{
    if (e->newer)
        e->newer->older = e->older;
    else
        m->newest = e->older;
    if (e->older)
        e->older->newer = e->newer;
    else
        m->oldest = e->newer;
    e->newer = e->older = NULL;
}

static void memo_push(Memo *m, MemoEntry *e)
{
    e->older = m->newest;
    e->newer = NULL;
    if (m->newest)
        m->newest->newer = e;
    m->newest = e;
    if (m->oldest == NULL)
        m->oldest = e;
}

static size_t memo_size(const MemoEntry *e)
{
    return sizeof(MemoEntry) + e->seen_len + e->tail_len;
}

/* Drops the entry *at points to. */
static void memo_drop(Memo *m, MemoEntry **at)
{
    MemoEntry *e = *at;
    *at = e->chain;
    memo_unlink(m, e);
    m->entries--;
    m->bytes -= memo_size(e);
    free(e);
}

/* Puts e (its key, hash and bytes filled in) in place of any entry of the same key, then drops the
   least recently used until the bounds hold. */
static void memo_insert(Memo *m, MemoEntry *e)
{
    MemoEntry **at = memo_slot(m, e->klass, e->hash, e->data, e->seen_len);
    if (*at != NULL)
        memo_drop(m, at);
    e->chain = m->buckets[e->hash & (MEMO_BUCKETS - 1)];
    m->buckets[e->hash & (MEMO_BUCKETS - 1)] = e;
    memo_push(m, e);
    m->entries++;
    m->bytes += memo_size(e);
    m->stored++;
    while (m->entries > MEMO_MAX_ENTRIES || m->bytes > MEMO_MAX_BYTES) {
        MemoEntry *old = m->oldest;
        MemoEntry **slot = memo_slot(m, old->klass, old->hash, old->data, old->seen_len);
        memo_drop(m, slot);
    }
}

static void memo_clear(Memo *m)
{
    for (int i = 0; i < MEMO_BUCKETS; i++) {
        while (m->buckets[i] != NULL)
            memo_drop(m, &m->buckets[i]);
    }
}

/* The answer to e (size bytes at p, behind its size prefix) of an api the lane serves only from the
   memo: its remembered rewrite queued for the client behind the client's correlation id, and the
   bytes queued returned; on a miss, 0, and the connection given back with this answer unread (what
   came before it, at pos, dropped as relayed). Never the broker's bytes: they name the broker. */
static size_t remembered_answer(Conn *c, const Api *api, const Entry *e, const uint8_t *p, size_t size,
                                size_t pos, size_t bound)
{
    Memo *m = &c->lane->memo;
    const uint8_t *seen = p + 8;
    size_t n = size - 4;
    /* Once recalled (a rules reload), what the class stood for may be gone: the Python path answers. */
    MemoEntry *got = c->recall ? NULL : *memo_slot(m, api->klass, memo_hash(api->klass, seen, n), seen, n);
    if (got == NULL) {
        char detail[160];
        m->misses += !c->recall;
        buf_drop(&c->bin, pos);
        snprintf(detail, sizeof detail, "an api %d v%d answer of %zu bytes %s", e->key, e->version, size + 4,
                 c->recall ? "after a recall" : "not in the lane's memo");
        give_back(c, c->recall ? "recalled" : "answer_unknown", detail);
        return 0;
    }
    m->hits++;
    memo_unlink(m, got);
    memo_push(m, got);
    uint8_t head[8];
    wr32(head, (int32_t)(got->tail_len + 4));
    wr32(head + 4, e->client_cid);
    size_t mark = c->cout.len;
    if (buf_put(&c->cout, head, 8, bound) < 0 || buf_put(&c->cout, got->data + got->seen_len, got->tail_len, bound) < 0) {
        c->cout.len = mark;
        buf_drop(&c->bin, pos);
        give_back(c, "client_error", "out of memory queueing an answer");
        return 0;
    }
    return 8 + (size_t)got->tail_len;
}

/* Relays the whole answers at the front of bin, in order, as far as the client's buffer allows. */
static void broker_frames(Conn *c, double now)
{
    Lane *l = c->lane;
    size_t pos = 0;
    const size_t bound = (size_t)(l->write_limit + l->max_frame + 4);
    char detail[160];
    while (c->state == ADOPTED) {
        if (c->cout.len >= (size_t)l->write_limit)
            break;
        size_t have = c->bin.len - pos;
        if (have < 4)
            break;
        uint8_t *p = c->bin.buf + pos;
        int32_t size = rd32(p);
        if (size < 4 || size > l->max_frame) {
            buf_drop(&c->bin, pos);
            snprintf(detail, sizeof detail, "an answer frame of %d bytes (the lane takes 4 to %zd)",
                     (int)size, l->max_frame);
            give_back(c, "bad_answer", detail);
            return;
        }
        if (have - 4 < (size_t)size)
            break;
        int32_t up = rd32(p + 4);
        if (c->count == 0 || c->ring[c->head].up_cid != up) {
            int i = 0;
            while (i < c->nunowed && c->unowed[i].up_cid != up)
                i++;
            if (i == c->nunowed) {
                buf_drop(&c->bin, pos);
                if (c->count)
                    snprintf(detail, sizeof detail, "an answer with correlation id %d where %d is owed",
                             (int)up, (int)c->ring[c->head].up_cid);
                else
                    snprintf(detail, sizeof detail, "an answer with correlation id %d where none is owed",
                             (int)up);
                give_back(c, "bad_answer", detail);
                return;
            }
            memmove(c->unowed + i, c->unowed + i + 1, sizeof(Unowed) * (size_t)(c->nunowed - i - 1));
            c->nunowed--;
            pos += 4 + (size_t)size;
            continue;
        }
        Entry *e = &c->ring[c->head];
        const Api *api = find_api(c, (int32_t)((uint32_t)(uint16_t)e->key << 16 | (uint16_t)e->version));
        if (api != NULL && api->walk && !answer_walked(c, e, p + 4, (size_t)size, pos))
            return;
        int ms = 0, has = api != NULL && api->throttle_at >= 0 && read_throttle(p + 4, (size_t)size, api->throttle_at, &ms);
        size_t sent = 4 + (size_t)size;
        if (api != NULL && api->remember) {
            if ((sent = remembered_answer(c, api, e, p, (size_t)size, pos, bound)) == 0)
                return;
        } else {
            wr32(p + 4, e->client_cid);
            if (buf_put(&c->cout, p, 4 + (size_t)size, bound) < 0) {
                wr32(p + 4, up);
                buf_drop(&c->bin, pos);
                give_back(c, "client_error", "out of memory queueing an answer");
                return;
            }
        }
        count_answer(l, e->key, e->len + 4, sent, now - e->t, ms, has);
        c->bytes_out += sent;
        __atomic_add_fetch(&total_answers, 1, __ATOMIC_RELAXED);
        held_add(-(int64_t)e->len);
        free(e->request);
        e->request = NULL;
        c->head = (c->head + 1) % c->max_in_flight;
        c->count--;
        if (c->count && c->request_to > 0)
            note_deadline(l, c->ring[c->head].t + c->request_to);
        pos += 4 + (size_t)size;
    }
    if (pos)
        buf_drop(&c->bin, pos);
}

/* Reads what the socket holds (up to the buffer's room) and relays it; 1 when it gave back. */
static int read_side(Conn *c, Side *s, double now)
{
    Lane *l = c->lane;
    Buf *in = s->client ? &c->cin : &c->bin;
    for (;;) {
        if (c->state != ADOPTED)
            return 1;
        if (s->client ? (c->want_give || c->recall || c->count >= c->max_in_flight
                         || c->bout.len >= (size_t)l->write_limit)
                      : c->cout.len >= (size_t)l->write_limit)
            return 0;
        if (s->client && over_budget(l)) {
            /* Brokers are still read: their answers are what frees memory. */
            c->starved = l->starved = 1;
            return 0;
        }
        size_t room = in->cap - in->len;
        if (room == 0) {
            /* Full: the frame at its front is larger than the buffer is yet, or it is whole and
               waits for the limits above. */
            int grown = buf_grow(in, (size_t)l->max_frame + 4);
            if (grown < 0) {
                give_back(c, s->client ? "client_error" : "broker_error", "out of memory reading a frame");
                return 1;
            }
            if (grown == 0)
                return 0;
            room = in->cap - in->len;
        }
        ssize_t n = recv(s->fd, in->buf + in->len, room, MSG_DONTWAIT);
        if (n > 0) {
            in->len += (size_t)n;
            if (s->client) {
                c->last_rx = now;
                if (c->partial_since == 0)
                    c->partial_since = now;
                client_frames(c, now);
                if (c->cin.len == 0)
                    c->partial_since = 0;
                else if (c->frame_to > 0)
                    note_deadline(l, c->partial_since + c->frame_to);
            } else {
                broker_frames(c, now);
            }
            if ((size_t)n < room)
                return c->state != ADOPTED;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        char detail[160];
        if (n == 0)
            snprintf(detail, sizeof detail, "the %s closed the connection", s->client ? "client" : "broker");
        else
            snprintf(detail, sizeof detail, "reading from the %s: %s", s->client ? "client" : "broker",
                     strerror(errno));
        give_back(c, n == 0 ? (s->client ? "client_closed" : "broker_closed")
                            : (s->client ? "client_error" : "broker_error"), detail);
        return 1;
    }
}

/* One look at a connection: read what is ready, relay, write, give back if due, set what to wait for. */
static void service(Conn *c, int client_ready, int broker_ready, double now)
{
    Lane *l = c->lane;
    if (c->state != ADOPTED)
        return;
    /* Answers first: they free room in the in-flight queue for the requests behind them. */
    if (broker_ready && read_side(c, &c->bs, now))
        return;
    if (client_ready && read_side(c, &c->cs, now))
        return;
    for (int round = 0; round < 2; round++) {
        flush_side(&c->cout, c->cs.fd);
        flush_side(&c->bout, c->bs.fd);
        /* Frames already received, held back by a limit that the writes or answers just lifted. */
        if (c->bin.len >= 4)
            broker_frames(c, now);
        if (c->state != ADOPTED)
            return;
        if (c->cin.len >= 4)
            client_frames(c, now);
        if (c->state != ADOPTED)
            return;
    }
    if ((c->want_give || c->recall) && c->count == 0) {
        if (c->want_give)
            give_back(c, "frame", c->detail);
        else
            give_back(c, "recalled", "recalled at a frame boundary");
        return;
    }
    int read_client = !c->want_give && !c->recall && !c->starved && c->count < c->max_in_flight
                      && c->bout.len < (size_t)l->write_limit && c->cin.len < c->cin.cap;
    int read_broker = c->cout.len < (size_t)l->write_limit && c->bin.len < c->bin.cap;
    /* EPOLLRDHUP is not asked for: a half-closed client still gets its answers, and the read of 0
       bytes says it. */
    set_mask(c, &c->cs, (read_client ? EPOLLIN : 0) | (c->cout.len ? EPOLLOUT : 0));
    set_mask(c, &c->bs, (read_broker ? EPOLLIN : 0) | (c->bout.len ? EPOLLOUT : 0));
}

/* The watchdog's three timeouts, for every connection; sets the next time to look. */
static void scan_timeouts(Lane *l, double now)
{
    l->next_scan = 0;
    Conn *c = l->conns;
    while (c != NULL) {
        Conn *next = c->next;
        char detail[160];
        if (c->count && c->request_to > 0) {
            double age = now - c->ring[c->head].t;
            if (age >= c->request_to) {
                snprintf(detail, sizeof detail, "api %d v%d request unanswered for %.3f s", c->ring[c->head].key,
                         c->ring[c->head].version, age);
                give_back(c, "request_timeout", detail);
                c = next;
                continue;
            }
            note_deadline(l, c->ring[c->head].t + c->request_to);
        }
        if (c->cin.len && c->partial_since > 0 && c->frame_to > 0) {
            if (now - c->partial_since >= c->frame_to) {
                snprintf(detail, sizeof detail, "a partial request frame for %.3f s", now - c->partial_since);
                give_back(c, "frame_timeout", detail);
                c = next;
                continue;
            }
            note_deadline(l, c->partial_since + c->frame_to);
        }
        if (c->shrink_at > 0 && now >= c->shrink_at) {
            /* Only once the client has been silent that long: a connection busy with large frames
               keeps its buffers (shrinking between them would realloc twice a frame). */
            double quiet_until = c->last_rx + SHRINK_AFTER_S;
            if (now >= quiet_until) {
                buf_shrink(&c->cin); buf_shrink(&c->bin); buf_shrink(&c->cout); buf_shrink(&c->bout);
            }
            /* Busy, or one still holding more than half of IN_START: another look later. */
            c->shrink_at = c->cout.cap > IN_START || c->bout.cap > IN_START || c->cin.cap > IN_START
                           || c->bin.cap > IN_START ? (now >= quiet_until ? now + SHRINK_AFTER_S : quiet_until) : 0;
        }
        note_deadline(l, c->shrink_at);
        if (c->count == 0 && c->idle_to > 0) {
            if (now - c->last_rx >= c->idle_to) {
                snprintf(detail, sizeof detail, "the client silent for %.3f s", now - c->last_rx);
                give_back(c, "idle", detail);
                c = next;
                continue;
            }
            note_deadline(l, c->last_rx + c->idle_to);
        }
        c = next;
    }
}

static void *lane_main(void *arg)
{
    Lane *l = arg;
    struct epoll_event evs[256];
    for (;;) {
        int timeout = -1;
        pthread_mutex_lock(&l->mu);
        if (l->next_scan > 0) {
            double wait = l->next_scan - now_s();
            timeout = wait <= 0 ? 0 : (int)(wait * 1000) + 1;
        }
        pthread_mutex_unlock(&l->mu);
        int n = epoll_wait(l->ep, evs, 256, timeout);
        if (n < 0 && errno != EINTR)
            n = 0;
        pthread_mutex_lock(&l->mu);
        double now = now_s();
        for (int i = 0; i < n; i++) {
            Side *s = evs[i].data.ptr;
            if (s == NULL) {
                uint64_t v;
                if (read(l->wake, &v, sizeof v) < 0) {
                    /* EAGAIN: another batch drained it */
                }
                continue;
            }
            Conn *c = s->conn;
            if (c->state != ADOPTED)
                continue;       /* given back earlier in this batch, or detached before it */
            uint32_t e = evs[i].events;
            if ((e & (EPOLLHUP | EPOLLERR)) && !(s->mask & EPOLLIN)) {
                /* Reported whatever the mask: a side not being read (a limit holds it) that hangs
                   up would wake the lane for ever. */
                give_back(c, s->client ? "client_error" : "broker_error",
                          s->client ? "the client's socket hung up" : "the broker's socket hung up");
                continue;
            }
            int ready = (e & (EPOLLIN | EPOLLHUP | EPOLLERR)) != 0;
            service(c, s->client && ready, !s->client && ready, now);
        }
        if (l->stopping) {
            while (l->conns != NULL)
                give_back(l->conns, "closed", "the lane closed");
        }
        if (l->starved && !over_budget(l)) {
            /* Room again: every connection that stopped reading its client for it gets a look. */
            l->starved = 0;
            for (Conn *c = l->conns; c != NULL; c = c->next)
                c->kick |= c->starved;
            l->kicked = 1;
        }
        if (l->kicked) {
            l->kicked = 0;
            for (Conn *c = l->conns, *next; c != NULL; c = next) {
                next = c->next;
                if (c->kick) {
                    c->kick = 0;
                    c->starved = 0;
                    service(c, 1, 1, now);
                }
            }
        }
        if (l->next_scan > 0 && now >= l->next_scan)
            scan_timeouts(l, now);
        if (l->starved)
            note_deadline(l, now + BUDGET_POLL_S);
        while (l->dead != NULL) {
            Conn *c = l->dead;
            l->dead = c->next;
            conn_free_raw(c);
        }
        int stop = l->stopping;
        pthread_mutex_unlock(&l->mu);
        if (stop)
            return NULL;
    }
}

/* ---- Python: Handle ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    Lane *lane;         /* a strong reference */
    Conn *conn;
    int taken;
} HandleObject;

static PyTypeObject HandleType;

static void release_apis(Conn *c)
{
    for (Py_ssize_t i = 0; i < c->napis; i++) {
        Py_CLEAR(c->apis[i].header);
        Py_CLEAR(c->apis[i].body);
    }
    PyMem_Free(c->apis);
    c->apis = NULL;
    c->napis = 0;
}

static void lane_wake(Lane *l)
{
    uint64_t one = 1;
    if (write(l->wake, &one, sizeof one) < 0) {
        /* EAGAIN: a wake-up is already pending */
    }
}

/* Detach under the mutex: the fds leave the epoll before this returns. */
static void detach_locked(Conn *c)
{
    if (c->state == ADOPTED) {
        unregister(c);
        snprintf(c->reason, sizeof c->reason, "detached");
        snprintf(c->detail, sizeof c->detail, "detached by the caller");
        c->given_at = now_s();
        __atomic_add_fetch(&total_given, 1, __ATOMIC_RELAXED);
    }
    c->state = DETACHED;
}

/* Appends one LaneEntry's fields to `entries`; -1 on error. */
static int add_entry(PyObject *entries, int client_cid, int key, int version, int up_cid, double age,
                     const uint8_t *request, uint32_t len, int no_response)
{
    PyObject *t = Py_BuildValue("(iiiidy#O)", client_cid, key, version, up_cid, age, (const char *)request,
                                (Py_ssize_t)len, no_response ? Py_True : Py_False);
    int err = t == NULL || PyList_Append(entries, t) < 0;
    Py_XDECREF(t);
    return err ? -1 : 0;
}

static PyObject *given_tuple(Conn *c)
{
    PyObject *entries = PyList_New(0);
    if (entries == NULL)
        return NULL;
    for (int i = 0; i < c->count; i++) {
        Entry *e = &c->ring[(c->head + i) % c->max_in_flight];
        if (add_entry(entries, e->client_cid, e->key, e->version, e->up_cid, c->given_at - e->t, e->request,
                      e->len, 0) < 0)
            goto fail;
    }
    for (int i = 0; i < c->nunowed; i++) {
        Unowed *u = &c->unowed[i];
        if (add_entry(entries, 0, u->key, u->version, u->up_cid, c->given_at - u->t, (const uint8_t *)"", 0, 1) < 0)
            goto fail;
    }
    PyObject *cid;
    if (c->client_id == NULL)
        cid = Py_NewRef(Py_None);
    else
        cid = PyBytes_FromStringAndSize((const char *)c->client_id, c->client_id_len);
    if (cid == NULL)
        goto fail;
    return Py_BuildValue("(ssy#y#iNKKKdNy#y#)", c->reason, c->detail, (const char *)c->cin.buf,
                         (Py_ssize_t)c->cin.len, (const char *)c->bin.buf, (Py_ssize_t)c->bin.len, (int)c->next_cid,
                         entries, (unsigned long long)c->requests, (unsigned long long)c->bytes_in,
                         (unsigned long long)c->bytes_out, c->given_at - c->last_rx, cid,
                         (const char *)c->cout.buf, (Py_ssize_t)c->cout.len, (const char *)c->bout.buf,
                         (Py_ssize_t)c->bout.len);
fail:
    Py_DECREF(entries);
    return NULL;
}

static PyObject *handle_recall(HandleObject *self, PyObject *unused)
{
    (void)unused;
    Lane *l = self->lane;
    pthread_mutex_lock(&l->mu);
    if (self->conn->state == ADOPTED) {
        self->conn->recall = 1;
        self->conn->kick = 1;
        l->kicked = 1;
    }
    pthread_mutex_unlock(&l->mu);
    lane_wake(l);
    Py_RETURN_NONE;
}

static PyObject *handle_finish(HandleObject *self, int detach)
{
    Lane *l = self->lane;
    if (self->taken) {
        PyErr_SetString(PyExc_RuntimeError, "this connection was already taken back or detached");
        return NULL;
    }
    Conn *c = self->conn;
    pthread_mutex_lock(&l->mu);
    if (!detach && c->state == ADOPTED) {
        pthread_mutex_unlock(&l->mu);
        PyErr_SetString(PyExc_RuntimeError, "the lane has not given this connection back yet");
        return NULL;
    }
    if (detach)
        detach_locked(c);
    pthread_mutex_unlock(&l->mu);
    /* From here on the lane does not touch this connection (it is not ADOPTED and not in its list). */
    self->taken = 1;
    PyObject *t = given_tuple(c);
    release_apis(c);
    return t;
}

static PyObject *handle_take(HandleObject *self, PyObject *unused)
{
    (void)unused;
    return handle_finish(self, 0);
}

static PyObject *handle_detach(HandleObject *self, PyObject *unused)
{
    (void)unused;
    return handle_finish(self, 1);
}

static PyObject *handle_progress(HandleObject *self, PyObject *unused)
{
    (void)unused;
    Lane *l = self->lane;
    pthread_mutex_lock(&l->mu);
    unsigned long long requests = self->conn->requests, in = self->conn->bytes_in, out = self->conn->bytes_out;
    pthread_mutex_unlock(&l->mu);
    return Py_BuildValue("(KKK)", requests, in, out);
}

static PyObject *handle_fd(HandleObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->conn->efd);
}

static void handle_dealloc(HandleObject *self)
{
    Lane *l = self->lane;
    Conn *c = self->conn;
    if (c != NULL) {
        pthread_mutex_lock(&l->mu);
        detach_locked(c);       /* dropped while adopted: the lane lets go of the fds first */
        pthread_mutex_unlock(&l->mu);
        release_apis(c);        /* the lane reads the programs only of a connection it holds */
        pthread_mutex_lock(&l->mu);
        close(c->efd);
        c->efd = -1;
        int running = l->started && !l->closed;
        if (running) {
            /* The current batch may still name it: the lane frees it after the batch. */
            c->next = l->dead;
            l->dead = c;
        }
        pthread_mutex_unlock(&l->mu);
        if (running)
            lane_wake(l);       /* its memory goes back now, not at the lane's next event */
        else
            conn_free_raw(c);
    }
    Py_XDECREF(l);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef handle_methods[] = {
    {"recall", (PyCFunction)handle_recall, METH_NOARGS, "Give the connection back at the next frame boundary."},
    {"take", (PyCFunction)handle_take, METH_NOARGS, "The state given back (a tuple; lane.py makes it a Given)."},
    {"detach", (PyCFunction)handle_detach, METH_NOARGS, "Stop touching both fds now; the state as it is."},
    {"progress", (PyCFunction)handle_progress, METH_NOARGS,
     "(requests, bytes_in, bytes_out) relayed since adopt, as of now (for /clients)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef handle_getset[] = {
    {"fd", (getter)handle_fd, NULL, "readable once the lane has given the connection back", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HandleType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kproxy.server._lane.Handle",
    .tp_doc = "One connection adopted by a lane.",
    .tp_basicsize = sizeof(HandleObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)handle_dealloc,
    .tp_methods = handle_methods,
    .tp_getset = handle_getset,
};

/* ---- Python: Lane -------------------------------------------------------------------------------- */

static PyObject *lane_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_frame", "write_limit", NULL};
    Py_ssize_t max_frame = 65536, write_limit = 256 * 1024;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$nn:Lane", kwlist, &max_frame, &write_limit))
        return NULL;
    if (max_frame < 8 || max_frame > (1 << 30) || write_limit < 1 || write_limit > (1 << 30)) {
        PyErr_SetString(PyExc_ValueError, "max_frame must be 8 to 2**30 and write_limit 1 to 2**30");
        return NULL;
    }
    Lane *l = (Lane *)type->tp_alloc(type, 0);
    if (l == NULL)
        return NULL;
    l->ep = l->wake = -1;
    l->max_frame = max_frame;
    l->write_limit = write_limit;
    l->rng = 0x9E3779B97F4A7C15ULL;
    l->budget_limit = -1;
    pthread_mutex_init(&l->mu, NULL);
    l->stats = calloc(MAX_API, sizeof(ApiStats));
    l->ep = epoll_create1(EPOLL_CLOEXEC);
    l->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (l->stats == NULL || l->ep < 0 || l->wake < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(l);
        return NULL;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(l->ep, EPOLL_CTL_ADD, l->wake, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(l);
        return NULL;
    }
    return (PyObject *)l;
}

static void lane_stop(Lane *l)
{
    pthread_mutex_lock(&l->mu);
    int join = l->started && !l->closed;
    l->stopping = 1;
    pthread_mutex_unlock(&l->mu);
    if (join) {
        lane_wake(l);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(l->thread, NULL);
        Py_END_ALLOW_THREADS
    }
    pthread_mutex_lock(&l->mu);
    l->closed = 1;
    while (l->dead != NULL) {
        Conn *c = l->dead;
        l->dead = c->next;
        conn_free_raw(c);
    }
    pthread_mutex_unlock(&l->mu);
}

static void lane_dealloc(Lane *l)
{
    /* Handles hold a reference: none is left, so no connection is adopted any more. */
    lane_stop(l);
    if (l->ep >= 0)
        close(l->ep);
    if (l->wake >= 0)
        close(l->wake);
    free(l->stats);
    memo_clear(&l->memo);
    pthread_mutex_destroy(&l->mu);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static PyObject *lane_close(Lane *l, PyObject *unused)
{
    (void)unused;
    lane_stop(l);
    Py_RETURN_NONE;
}

static int start_thread(Lane *l)
{
    /* The lane thread takes no signals: Python handles them in the main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = pthread_create(&l->thread, NULL, lane_main, l);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    l->started = 1;
    return 0;
}

static int api_order(const void *a, const void *b)
{
    int32_t x = ((const Api *)a)->key_version, y = ((const Api *)b)->key_version;
    return x < y ? -1 : x > y;
}

PyDoc_STRVAR(adopt_doc,
"adopt(client_fd, broker_fd, apis, next_correlation_id, client_bytes, client_id, max_in_flight,\n"
"      request_timeout_s, idle_timeout_s, frame_timeout_s) -> Handle\n\n"
"apis: a sequence of (api_key, api_version, header Program, body Program, throttle_at[, walk,\n"
"remember, memo_class]): walk (Produce and Fetch only) has each answer walked for node_endpoints\n"
"first (given back if it has them); with remember, answers go to the client only as the memo\n"
"remembers them.");

static PyObject *lane_adopt(Lane *l, PyObject *args)
{
    int cfd, bfd, next_cid, max_in_flight;
    PyObject *apis_seq, *client_id_obj;
    Py_buffer cb;
    double request_to, idle_to, frame_to;
    if (!PyArg_ParseTuple(args, "iiOiy*Oiddd:adopt", &cfd, &bfd, &apis_seq, &next_cid, &cb, &client_id_obj,
                          &max_in_flight, &request_to, &idle_to, &frame_to))
        return NULL;
    PyObject *seq = NULL;
    Conn *c = NULL;
    HandleObject *h = NULL;
    if (cfd < 0 || bfd < 0 || cfd == bfd || max_in_flight < 1 || max_in_flight > 1 << 16 || next_cid < 0) {
        PyErr_SetString(PyExc_ValueError, "adopt: bad fds, max_in_flight (1 to 65536) or correlation id");
        goto fail;
    }
    if (client_id_obj != Py_None && !PyBytes_Check(client_id_obj)) {
        PyErr_SetString(PyExc_TypeError, "adopt: client_id must be bytes or None");
        goto fail;
    }
    if (cb.len > l->max_frame + 4) {
        /* More than one frame's worth: the caller relays what it holds before handing over. */
        PyErr_SetString(PyExc_ValueError, "adopt: client_bytes longer than max_frame + 4");
        goto fail;
    }
    if ((seq = PySequence_Fast(apis_seq, "adopt: apis must be a sequence")) == NULL)
        goto fail;
    c = calloc(1, sizeof(Conn));
    if (c == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    c->lane = l;
    c->efd = -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    c->apis = PyMem_Calloc((size_t)n + 1, sizeof(Api));
    if (c->apis == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PySequence_Fast_GET_ITEM(seq, i);
        int key, version, throttle_at, walk = 0, remember = 0;
        unsigned long long klass = 0;
        PyObject *header, *body;
        if (!PyArg_ParseTuple(row, "iiO!O!i|ppK:adopt's apis", &key, &version, accel->program_type, &header,
                              accel->program_type, &body, &throttle_at, &walk, &remember, &klass))
            goto fail;
        if (walk && key != PRODUCE && key != FETCH) {
            PyErr_SetString(PyExc_ValueError, "adopt: only Produce and Fetch answers are walked");
            goto fail;
        }
        if (key < 0 || key >= MAX_API || version < 0 || version > 0x7FFF) {
            PyErr_SetString(PyExc_ValueError, "adopt: api key or version out of range");
            goto fail;
        }
        c->apis[i] = (Api){(int32_t)(key << 16 | version), throttle_at, walk, Py_NewRef(header), Py_NewRef(body),
                           remember, (uint64_t)klass};
        c->napis = i + 1;
    }
    qsort(c->apis, (size_t)c->napis, sizeof(Api), api_order);
    if (client_id_obj != Py_None) {
        c->client_id_len = PyBytes_GET_SIZE(client_id_obj);
        c->client_id = malloc((size_t)c->client_id_len + 1);
        if (c->client_id == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        memcpy(c->client_id, PyBytes_AS_STRING(client_id_obj), (size_t)c->client_id_len);
    }
    c->next_cid = next_cid;
    c->max_in_flight = max_in_flight;
    c->request_to = request_to;
    c->idle_to = idle_to;
    c->frame_to = frame_to;
    /* The input buffers start small (what was handed over, plus IN_START) and grow to the frame a
       size prefix announces, at most max_frame + 4: every read is bounded by them. */
    size_t most = (size_t)l->max_frame + 4;
    size_t cin_cap = (size_t)cb.len + IN_START < most ? (size_t)cb.len + IN_START : most;
    size_t bin_cap = IN_START < most ? IN_START : most;
    c->ring = calloc((size_t)max_in_flight, sizeof(Entry));
    if (buf_resize(&c->cin, cin_cap) < 0 || buf_resize(&c->bin, bin_cap) < 0 || c->ring == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    memcpy(c->cin.buf, cb.buf, (size_t)cb.len);
    c->cin.len = (size_t)cb.len;
    c->cs = (Side){c, cfd, 1, EPOLLIN};
    c->bs = (Side){c, bfd, 0, EPOLLIN};
    c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    h = PyObject_New(HandleObject, &HandleType);
    if (h == NULL)
        goto fail;
    h->lane = (Lane *)Py_NewRef(l);
    h->conn = NULL;
    h->taken = 0;
    pthread_mutex_lock(&l->mu);
    if (l->stopping) {
        pthread_mutex_unlock(&l->mu);
        PyErr_SetString(PyExc_RuntimeError, "adopt: the lane is closed");
        goto fail;
    }
    if (!l->started && start_thread(l) < 0) {
        pthread_mutex_unlock(&l->mu);
        goto fail;
    }
    double now = now_s();
    c->last_rx = now;
    c->partial_since = c->cin.len ? now : 0;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &c->cs};
    if (epoll_ctl(l->ep, EPOLL_CTL_ADD, cfd, &ev) < 0) {
        pthread_mutex_unlock(&l->mu);
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    ev.data.ptr = &c->bs;
    if (epoll_ctl(l->ep, EPOLL_CTL_ADD, bfd, &ev) < 0) {
        epoll_ctl(l->ep, EPOLL_CTL_DEL, cfd, NULL);
        pthread_mutex_unlock(&l->mu);
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    c->state = ADOPTED;
    c->cin.conn = c->bin.conn = c->cout.conn = c->bout.conn = c;
    if (c->cin.cap > IN_START) {
        /* What was handed over made it larger: back to IN_START once it is relayed. */
        c->shrink_at = now + SHRINK_AFTER_S;
        note_deadline(l, c->shrink_at);
    }
    c->next = l->conns;
    if (l->conns)
        l->conns->prev = c;
    l->conns = c;
    if (c->idle_to > 0)
        note_deadline(l, now + c->idle_to);
    if (c->cin.len && c->frame_to > 0)
        note_deadline(l, now + c->frame_to);
    c->kick = l->kicked = 1;      /* client_bytes may already hold whole frames */
    h->conn = c;
    __atomic_add_fetch(&total_adopted, 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&l->mu);
    lane_wake(l);
    PyBuffer_Release(&cb);
    Py_DECREF(seq);
    return (PyObject *)h;
fail:
    PyBuffer_Release(&cb);
    Py_XDECREF(seq);
    Py_XDECREF(h);
    if (c != NULL) {
        if (c->efd >= 0)
            close(c->efd);
        release_apis(c);
        conn_free_raw(c);
    }
    return NULL;
}

PyDoc_STRVAR(counts_doc,
"counts() -> {api_key: (count, request_bytes, response_bytes, latency_sum_s, (latency, ...),\n"
"                       throttle_ms_sum, throttled)}\n\n"
"What the lane relayed since the previous call, per api key.");

static PyObject *lane_counts(Lane *l, PyObject *unused)
{
    (void)unused;
    ApiStats *copy = malloc(MAX_API * sizeof(ApiStats));
    if (copy == NULL)
        return PyErr_NoMemory();
    pthread_mutex_lock(&l->mu);
    memcpy(copy, l->stats, MAX_API * sizeof(ApiStats));
    memset(l->stats, 0, MAX_API * sizeof(ApiStats));
    pthread_mutex_unlock(&l->mu);
    PyObject *out = PyDict_New();
    for (int k = 0; out != NULL && k < MAX_API; k++) {
        ApiStats *s = &copy[k];
        if (s->count == 0)
            continue;
        PyObject *sample = PyTuple_New(s->nsample), *t = NULL, *key = NULL;
        for (int i = 0; sample != NULL && i < s->nsample; i++) {
            PyObject *f = PyFloat_FromDouble(s->sample[i]);
            if (f == NULL)
                Py_CLEAR(sample);
            else
                PyTuple_SET_ITEM(sample, i, f);
        }
        if (sample != NULL)
            t = Py_BuildValue("(KKKdNKK)", (unsigned long long)s->count, (unsigned long long)s->request_bytes,
                              (unsigned long long)s->response_bytes, s->latency_sum, sample,
                              (unsigned long long)s->throttle_ms_sum, (unsigned long long)s->throttled);
        key = PyLong_FromLong(k);
        if (t == NULL || key == NULL || PyDict_SetItem(out, key, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
        Py_XDECREF(key);
    }
    free(copy);
    return out;
}

PyDoc_STRVAR(memo_put_doc,
"memo_put(memo_class, seen, tail) -> bool\n\n"
"Remember that an answer whose bytes after the correlation id are `seen` goes to a connection of\n"
"`memo_class` as `tail` (after the client's correlation id). False when it is too large to keep.");

static PyObject *lane_memo_put(Lane *l, PyObject *args)
{
    unsigned long long klass;
    Py_buffer seen, tail;
    if (!PyArg_ParseTuple(args, "Ky*y*:memo_put", &klass, &seen, &tail))
        return NULL;
    PyObject *result = Py_False;
    size_t need = sizeof(MemoEntry) + (size_t)seen.len + (size_t)tail.len;
    /* Both are whole frames the lane relays (the correlation id and these bytes within max_frame). */
    if (seen.len + 4 <= l->max_frame && tail.len + 4 <= l->max_frame && need <= MEMO_MAX_BYTES) {
        uint64_t h = memo_hash(klass, seen.buf, (size_t)seen.len);
        pthread_mutex_lock(&l->mu);
        MemoEntry *got = *memo_slot(&l->memo, klass, h, seen.buf, (size_t)seen.len);
        int same = got != NULL && got->tail_len == (size_t)tail.len
                   && memcmp(got->data + got->seen_len, tail.buf, (size_t)tail.len) == 0;
        if (same) {
            /* Served by the Python path's memo: the same again, kept as recently used. */
            memo_unlink(&l->memo, got);
            memo_push(&l->memo, got);
        }
        pthread_mutex_unlock(&l->mu);
        result = Py_True;
        if (!same) {
            MemoEntry *e = malloc(need);
            if (e == NULL) {
                PyBuffer_Release(&seen);
                PyBuffer_Release(&tail);
                return PyErr_NoMemory();
            }
            e->klass = klass;
            e->hash = h;
            e->seen_len = (uint32_t)seen.len;
            e->tail_len = (uint32_t)tail.len;
            memcpy(e->data, seen.buf, (size_t)seen.len);
            memcpy(e->data + seen.len, tail.buf, (size_t)tail.len);
            pthread_mutex_lock(&l->mu);
            memo_insert(&l->memo, e);
            pthread_mutex_unlock(&l->mu);
        }
    }
    PyBuffer_Release(&seen);
    PyBuffer_Release(&tail);
    return Py_NewRef(result);
}

static PyObject *lane_memo_clear(Lane *l, PyObject *unused)
{
    (void)unused;
    pthread_mutex_lock(&l->mu);
    memo_clear(&l->memo);
    pthread_mutex_unlock(&l->mu);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(memo_counts_doc,
"memo_counts() -> (entries, bytes, hits, misses, stored)\n\n"
"What the memo holds now, and its totals since the lane was made.");

static PyObject *lane_memo_counts(Lane *l, PyObject *unused)
{
    (void)unused;
    pthread_mutex_lock(&l->mu);
    Memo *m = &l->memo;
    size_t entries = m->entries, bytes = m->bytes;
    uint64_t hits = m->hits, misses = m->misses, stored = m->stored;
    pthread_mutex_unlock(&l->mu);
    return Py_BuildValue("(nnKKK)", (Py_ssize_t)entries, (Py_ssize_t)bytes, (unsigned long long)hits,
                         (unsigned long long)misses, (unsigned long long)stored);
}

PyDoc_STRVAR(budget_doc,
"budget(limit, outside) -> held\n\n"
"The process's buffer budget (limit; -1: none) and the bytes the Python path holds of it (outside):\n"
"the lane reads no client while held + outside >= limit. Returns held: what every lane of the\n"
"process holds now.");

static PyObject *lane_budget(Lane *l, PyObject *args)
{
    long long limit, outside;
    if (!PyArg_ParseTuple(args, "LL:budget", &limit, &outside))
        return NULL;
    __atomic_store_n(&l->budget_outside, (int64_t)outside, __ATOMIC_RELAXED);
    __atomic_store_n(&l->budget_limit, (int64_t)(limit < 0 ? -1 : limit), __ATOMIC_RELAXED);
    return PyLong_FromLongLong((long long)__atomic_load_n(&held, __ATOMIC_RELAXED));
}

static PyMethodDef lane_methods[] = {
    {"budget", (PyCFunction)lane_budget, METH_VARARGS, budget_doc},
    {"adopt", (PyCFunction)lane_adopt, METH_VARARGS, adopt_doc},
    {"memo_put", (PyCFunction)lane_memo_put, METH_VARARGS, memo_put_doc},
    {"memo_clear", (PyCFunction)lane_memo_clear, METH_NOARGS, "Forget every remembered answer."},
    {"memo_counts", (PyCFunction)lane_memo_counts, METH_NOARGS, memo_counts_doc},
    {"counts", (PyCFunction)lane_counts, METH_NOARGS, counts_doc},
    {"close", (PyCFunction)lane_close, METH_NOARGS, "Give every connection back (\"closed\") and stop the thread."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kproxy.server._lane.Lane",
    .tp_doc = "A relay thread without the GIL (see kproxy/server/lane.py).",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = lane_new,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_methods = lane_methods,
};

PyDoc_STRVAR(path_counts_doc,
"counts() -> (adopted, given_back, requests, answers)\n\n"
"Process totals of what every lane did (a path counter for tests).");

static PyObject *path_counts(PyObject *module, PyObject *unused)
{
    (void)module; (void)unused;
    return Py_BuildValue("(KKKK)", (unsigned long long)__atomic_load_n(&total_adopted, __ATOMIC_RELAXED),
                         (unsigned long long)__atomic_load_n(&total_given, __ATOMIC_RELAXED),
                         (unsigned long long)__atomic_load_n(&total_requests, __ATOMIC_RELAXED),
                         (unsigned long long)__atomic_load_n(&total_answers, __ATOMIC_RELAXED));
}

static PyObject *path_held(PyObject *module, PyObject *unused)
{
    (void)module; (void)unused;
    return PyLong_FromLongLong((long long)__atomic_load_n(&held, __ATOMIC_RELAXED));
}

static PyMethodDef module_methods[] = {
    {"counts", (PyCFunction)path_counts, METH_NOARGS, path_counts_doc},
    {"held", (PyCFunction)path_held, METH_NOARGS, "Bytes every lane of the process holds for its connections."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lane_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kproxy.server._lane",
    .m_doc = "kproxy's relay lane: a readiness loop in C, one thread, no GIL (optional; see lane.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__lane(void)
{
    /* PyCapsule_Import walks attributes from the top package: import the module itself first. */
    PyObject *accel_module = PyImport_ImportModule("kproxy.protocol._accel");
    if (accel_module == NULL)
        return NULL;
    Py_DECREF(accel_module);
    const AccelLaneAPI *api = PyCapsule_Import("kproxy.protocol._accel._C_API", 0);
    if (api == NULL)
        return NULL;
    if (api->abi != LANE_CAPI_ABI || api->size != sizeof(AccelLaneAPI)) {
        PyErr_SetString(PyExc_ImportError, "kproxy.protocol._accel's lane API differs from _lane's: rebuild both");
        return NULL;
    }
    accel = api;
    if (PyType_Ready(&LaneType) < 0 || PyType_Ready(&HandleType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&lane_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Lane", (PyObject *)&LaneType) < 0
            || PyModule_AddObjectRef(m, "Handle", (PyObject *)&HandleType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
