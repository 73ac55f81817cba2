/* The S3-FIFO mini-tier in C: the same decisions as ``minisim.S3FIFOMiniTier``, without a
 * Python-level loop per key.
 *
 * Under ``--policy s3fifo`` the optimiser's worlds and what-if mini-tiers are S3-FIFO
 * tiers, and their evictions (a main queue that reinserts a touched key up to three
 * times) were most of its manager time. The held keys are a bounded recency table
 * (``_recency.h``) whose own list is the small queue; the main queue is a second list
 * over the same nodes, and the ghost (keys the small queue evicted) a second table. The
 * store, touch and prefix reads are the touch-counting tiers' shared ones
 * (``_pending_tier.h``).
 *
 * Every operation mirrors the pure-Python tier step by step (``minisim.py`` says why
 * each step is there); ``tests/admission/test_minisim_fast.py`` holds the two equal.
 */
#include "_pending_tier.h"

#define IN_MAIN POLICY_FLAG  /* on the main queue (else the small one) */

typedef struct {
    PendingTier tier;
    Py_ssize_t main_oldest, main_newest, main_len;
    Recency ghost;             /* the small queue's victims, oldest first */
    unsigned char *freq;       /* per node: touches counted, at most max_freq */
    Py_ssize_t small_target;
    int max_freq;
} S3FIFOTier;

/* One pass over the small queue (``_from_small``): a protected key goes back, a touched
 * one moves to main with its count reset, the first untouched one leaves for the ghost.
 * 1 if a key left, 0 if none did, -1 on error. */
static int
from_small(S3FIFOTier *self)
{
    Recency *r = &self->tier.r;
    unsigned char *flags = self->tier.flags;
    Py_ssize_t rounds = r->size - self->main_len;
    for (Py_ssize_t i = 0; i < rounds; i++) {
        Py_ssize_t node = r->oldest;
        if (!(flags[node] & PROTECTED) && self->freq[node] == 0) {
            /* Remembered before it leaves: where the ghost's comparison fails, it stays. */
            if (ghost_remember(&self->tier, &self->ghost, node) < 0) {
                return -1;
            }
            recency_remove(r, node);
            return 1;
        }
        recency_unlink(r, node);
        if (flags[node] & PROTECTED) {
            recency_append(r, node);
        } else {
            self->freq[node] = 0;
            flags[node] |= IN_MAIN;
            list_append(r, &self->main_oldest, &self->main_newest, node);
            self->main_len++;
        }
    }
    return 0;
}

/* The main queue's clock (``_from_main``): a protected key goes back, a touched one goes
 * back with one touch less, the first untouched one leaves. 1, 0 or -1 as above. */
static int
from_main(S3FIFOTier *self)
{
    Recency *r = &self->tier.r;
    Py_ssize_t rounds = (self->max_freq + 1) * self->main_len;
    for (Py_ssize_t i = 0; i < rounds; i++) {
        Py_ssize_t node = self->main_oldest;
        list_unlink(r, &self->main_oldest, &self->main_newest, node);
        if (self->tier.flags[node] & PROTECTED) {
            list_append(r, &self->main_oldest, &self->main_newest, node);
        } else if (self->freq[node] > 0) {
            self->freq[node]--;
            list_append(r, &self->main_oldest, &self->main_newest, node);
        } else {
            self->main_len--;
            recency_forget(r, node);
            return 1;
        }
    }
    return 0;
}

/* ``_evict``'s order of queues. */
static int
evict(PendingTier *tier, Py_ssize_t n)
{
    S3FIFOTier *self = (S3FIFOTier *)tier;
    while (n) {
        int left;
        if (tier->r.size - self->main_len >= self->small_target || self->main_len == 0) {
            left = from_small(self);
            if (left < 0) {
                return -1;
            }
            if (left) {
                n--;
                continue;
            }
        }
        left = from_main(self);
        if (left == 0) {
            left = from_small(self);
        }
        if (left < 0) {
            return -1;
        }
        n -= left;
    }
    return 0;
}

/* A new key starts untouched, on the main queue if the ghost remembers it (the ghost then
 * forgets it), else on the small queue, where the table put it. */
static int
place(PendingTier *tier, Py_ssize_t node)
{
    S3FIFOTier *self = (S3FIFOTier *)tier;
    Recency *r = &tier->r;
    self->freq[node] = 0;
    int found = ghost_forget(tier, &self->ghost, node);
    if (found < 0) {
        return -1;
    }
    if (found) {
        recency_unlink(r, node);
        list_append(r, &self->main_oldest, &self->main_newest, node);
        self->main_len++;
        tier->flags[node] |= IN_MAIN;
    }
    return 0;
}

static void
touched(PendingTier *tier, Py_ssize_t node)
{
    S3FIFOTier *self = (S3FIFOTier *)tier;
    if (self->freq[node] < self->max_freq) {
        self->freq[node]++;
    }
}

static const PendingTierPolicy s3fifo_policy = {evict, place, touched, NULL};

static PyObject *
tier_memory_bytes(S3FIFOTier *self, void *Py_UNUSED(closure))
{
    Py_ssize_t capacity = self->tier.r.capacity;
    return PyLong_FromSsize_t(recency_bytes(&self->tier.r) + recency_bytes(&self->ghost) + 2 * capacity);
}

static int
tier_traverse(S3FIFOTier *self, visitproc visit, void *arg)
{
    int failed = pending_tier_traverse(&self->tier, visit, arg);
    return failed ? failed : recency_traverse(&self->ghost, visit, arg);
}

static void
tier_empty(PyObject *op)
{
    S3FIFOTier *self = (S3FIFOTier *)op;
    self->main_oldest = self->main_newest = NONE;
    self->main_len = 0;
    pending_tier_empty(&self->tier);
    recency_clear(&self->ghost);
}

static int
tier_clear(S3FIFOTier *self)
{
    return recency_object_clear((PyObject *)self, tier_empty);
}

static void
tier_dealloc(S3FIFOTier *self)
{
    PyObject_GC_UnTrack(self);
    pending_tier_free(&self->tier);
    recency_free(&self->ghost);
    PyMem_Free(self->freq);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
tier_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"capacity", "pending", "small_target", "max_freq", NULL};
    Py_ssize_t capacity, small_target;
    int pending, max_freq;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "npni:S3FIFOTier", names, &capacity, &pending,
                                     &small_target, &max_freq)) {
        return NULL;
    }
    if (!recency_capacity_ok(capacity, "mini-tier")) {
        return NULL;
    }
    if (small_target < 1 || max_freq < 0 || max_freq > 255) {
        recency_invalid("S3-FIFO needs small_target >= 1 and 0 <= max_freq <= 255");
        return NULL;
    }
    S3FIFOTier *self = (S3FIFOTier *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->main_oldest = self->main_newest = NONE;
    self->small_target = small_target;
    self->max_freq = max_freq;
    self->freq = PyMem_Calloc((size_t)capacity, 1);
    if (pending_tier_init(&self->tier, capacity, pending, &s3fifo_policy) < 0 ||
        recency_init(&self->ghost, capacity) < 0 || self->freq == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static PyMemberDef tier_members[] = {
    MINI_TIER_COUNTERS,
    {"small_target", T_PYSSIZET, offsetof(S3FIFOTier, small_target), READONLY,
     "Keys the small queue holds before it evicts first."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef tier_getset[] = {
    PENDING_TIER_GETTERS,
    {"memory_bytes", (getter)tier_memory_bytes, NULL, "Bytes of the tier's arrays.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject S3FIFOTierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.admission._s3fifo_tier.S3FIFOTier",
    .tp_basicsize = sizeof(S3FIFOTier),
    .tp_dealloc = (destructor)tier_dealloc,
    .tp_as_sequence = &recency_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "S3FIFOTier(capacity, pending, small_target, max_freq)\n--\n\nAn S3-FIFO mini-tier of capacity keys (no data): S3FIFOMiniTier's decisions in C.",
    .tp_traverse = (traverseproc)tier_traverse,
    .tp_clear = (inquiry)tier_clear,
    .tp_methods = pending_tier_methods,
    .tp_members = tier_members,
    .tp_getset = tier_getset,
    .tp_new = tier_new,
};

static struct PyModuleDef s3fifo_tier_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload.admission._s3fifo_tier",
    .m_doc = "The S3-FIFO mini-tier's hot paths in C (minisim.S3FIFOMiniTier is the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__s3fifo_tier(void)
{
    return recency_module(&s3fifo_tier_module, &S3FIFOTierType, "S3FIFOTier");
}
