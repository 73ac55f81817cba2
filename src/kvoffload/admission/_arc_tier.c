/* The ARC mini-tier in C: the same decisions as the generic ``minisim.MiniTier`` over
 * ``ARCCachePolicy`` (vLLM's ARC), without the policy object's per-key Python.
 *
 * Under ``--policy arc`` the optimiser's what-if mini-tiers (and the sampled 1x ones that
 * give its 1x figures there) are ARC tiers. The held keys are a bounded recency table
 * (``_recency.h``) whose own list is T1 (blocks seen once); T2 is a second list over the
 * same nodes, and the ghosts B1 and B2 are two more tables. The target size of T1 is a
 * float, adapted by touches of ghost keys, as in the policy. The store and prefix reads
 * are the touch-counting tiers' shared ones (``_pending_tier.h``).
 *
 * Every operation mirrors the generic tier step by step; ``tests/admission/
 * test_minisim_fast.py`` holds the two equal.
 */
#include "_pending_tier.h"

#define IN_T2 POLICY_FLAG  /* on T2 (else T1) */

typedef struct {
    PendingTier tier;
    Py_ssize_t t2_oldest, t2_newest, t2_len;
    Recency b1, b2;        /* T1's and T2's victims, oldest first */
    double target_t1_size;
} ARCTier;

/* Evict up to ``quota`` unprotected keys of T1 from ``*cursor`` on (the oldest first),
 * leaving ``*cursor`` after the last one taken (``take_evictable`` consumes no further);
 * how many, or -1. */
static Py_ssize_t
take_from_t1(ARCTier *self, Py_ssize_t *cursor, Py_ssize_t quota)
{
    Recency *r = &self->tier.r;
    Py_ssize_t taken = 0;
    while (taken < quota && *cursor != NONE) {
        Py_ssize_t node = *cursor;
        *cursor = r->next[node];
        if (!(self->tier.flags[node] & PROTECTED)) {
            if (ghost_remember(&self->tier, &self->b1, node) < 0) {
                return -1;
            }
            recency_remove(r, node);
            taken++;
        }
    }
    return taken;
}

/* ``ARCCachePolicy.evict``: T1 gives victims while it is at or above its target, then
 * T2, then T1 again (the fallback, where the first pass stopped). */
static int
evict(PendingTier *tier, Py_ssize_t n)
{
    ARCTier *self = (ARCTier *)tier;
    Recency *r = &tier->r;
    Py_ssize_t cursor = r->oldest;
    Py_ssize_t turns = (r->size - self->t2_len) - (Py_ssize_t)self->target_t1_size + 1;
    Py_ssize_t first = take_from_t1(self, &cursor, n < turns ? n : turns);
    if (first < 0) {
        return -1;
    }
    n -= first;
    Py_ssize_t node = self->t2_oldest;
    while (n && node != NONE) {
        Py_ssize_t after = r->next[node];
        if (!(tier->flags[node] & PROTECTED)) {
            /* Remembered before it leaves T2: where the ghost's comparison fails, it stays. */
            if (ghost_remember(&self->tier, &self->b2, node) < 0) {
                return -1;
            }
            list_unlink(r, &self->t2_oldest, &self->t2_newest, node);
            self->t2_len--;
            recency_forget(r, node);
            n--;
        }
        node = after;
    }
    return n && take_from_t1(self, &cursor, n) < 0 ? -1 : 0;
}

/* A new key joins T1 (where the table put it) and leaves whichever ghost held it. */
static int
place(PendingTier *tier, Py_ssize_t node)
{
    ARCTier *self = (ARCTier *)tier;
    int found = ghost_forget(tier, &self->b1, node);
    if (found == 0) {
        found = ghost_forget(tier, &self->b2, node);
    }
    return found < 0 ? -1 : 0;
}

/* ``ARCCachePolicy.touch``, the last key first: a settled T1 key moves to T2, a pending
 * one to T1's recent end, a T2 key to T2's; a ghost key moves the target of T1 (towards
 * T1 for B1, away for B2, by the other ghost's size over its own, at least 1) and
 * becomes its ghost's most recent. */
static int
touch(PendingTier *tier, PyObject **keys, Py_ssize_t n)
{
    ARCTier *self = (ARCTier *)tier;
    Recency *r = &tier->r;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        Py_hash_t hash;
        Py_ssize_t node = recency_find(r, keys[i], &hash);
        if (node == LOOKUP_FAILED) {
            return -1;
        }
        if (node != NONE) {
            if (tier->flags[node] & IN_T2) {
                list_unlink(r, &self->t2_oldest, &self->t2_newest, node);
                list_append(r, &self->t2_oldest, &self->t2_newest, node);
            } else if (tier->flags[node] & FRESH) {
                recency_make_newest(r, node);
            } else {
                recency_unlink(r, node);
                list_append(r, &self->t2_oldest, &self->t2_newest, node);
                self->t2_len++;
                tier->flags[node] |= IN_T2;
            }
            continue;
        }
        int found = 0;
        Py_ssize_t slot = 0;
        if (self->b1.size && (slot = recency_slot(&self->b1, keys[i], hash, &found)) < 0) {
            return -1;
        }
        if (found) {
            double delta = (double)self->b2.size / (double)self->b1.size;
            double target = self->target_t1_size + (delta > 1.0 ? delta : 1.0);
            double capacity = (double)r->capacity;
            self->target_t1_size = target <= capacity ? target : capacity;
            recency_make_newest(&self->b1, self->b1.table[slot]);
            continue;
        }
        if (self->b2.size && (slot = recency_slot(&self->b2, keys[i], hash, &found)) < 0) {
            return -1;
        }
        if (found) {
            double delta = (double)self->b1.size / (double)self->b2.size;
            double target = self->target_t1_size - (delta > 1.0 ? delta : 1.0);
            self->target_t1_size = target >= 0.0 ? target : 0.0;
            recency_make_newest(&self->b2, self->b2.table[slot]);
        }
    }
    return 0;
}

static const PendingTierPolicy arc_policy = {evict, place, NULL, touch};

static PyObject *
tier_memory_bytes(ARCTier *self, void *Py_UNUSED(closure))
{
    Py_ssize_t bytes = recency_bytes(&self->tier.r) + recency_bytes(&self->b1) + recency_bytes(&self->b2);
    return PyLong_FromSsize_t(bytes + self->tier.r.capacity);
}

static PyObject *
tier_target(ARCTier *self, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(self->target_t1_size);
}

static int
tier_traverse(ARCTier *self, visitproc visit, void *arg)
{
    int failed = pending_tier_traverse(&self->tier, visit, arg);
    failed = failed ? failed : recency_traverse(&self->b1, visit, arg);
    return failed ? failed : recency_traverse(&self->b2, visit, arg);
}

static void
tier_empty(PyObject *op)
{
    ARCTier *self = (ARCTier *)op;
    self->t2_oldest = self->t2_newest = NONE;
    self->t2_len = 0;
    self->target_t1_size = 0.0;
    pending_tier_empty(&self->tier);
    recency_clear(&self->b1);
    recency_clear(&self->b2);
}

static int
tier_clear(ARCTier *self)
{
    return recency_object_clear((PyObject *)self, tier_empty);
}

static void
tier_dealloc(ARCTier *self)
{
    PyObject_GC_UnTrack(self);
    pending_tier_free(&self->tier);
    recency_free(&self->b1);
    recency_free(&self->b2);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
tier_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"capacity", "pending", NULL};
    Py_ssize_t capacity;
    int pending = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|p:ARCTier", names, &capacity, &pending)) {
        return NULL;
    }
    if (!recency_capacity_ok(capacity, "mini-tier")) {
        return NULL;
    }
    ARCTier *self = (ARCTier *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->t2_oldest = self->t2_newest = NONE;
    if (pending_tier_init(&self->tier, capacity, pending, &arc_policy) < 0 ||
        recency_init(&self->b1, capacity) < 0 || recency_init(&self->b2, capacity) < 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static PyMemberDef tier_members[] = {
    MINI_TIER_COUNTERS,
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef tier_getset[] = {
    PENDING_TIER_GETTERS,
    {"memory_bytes", (getter)tier_memory_bytes, NULL, "Bytes of the tier's arrays.", NULL},
    {"target_t1_size", (getter)tier_target, NULL, "ARC's adaptive target size of T1.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ARCTierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.admission._arc_tier.ARCTier",
    .tp_basicsize = sizeof(ARCTier),
    .tp_dealloc = (destructor)tier_dealloc,
    .tp_as_sequence = &recency_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "ARCTier(capacity, pending=True)\n--\n\nAn ARC mini-tier of capacity keys (no data): the generic tier's decisions in C.",
    .tp_traverse = (traverseproc)tier_traverse,
    .tp_clear = (inquiry)tier_clear,
    .tp_methods = pending_tier_methods,
    .tp_members = tier_members,
    .tp_getset = tier_getset,
    .tp_new = tier_new,
};

static struct PyModuleDef arc_tier_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload.admission._arc_tier",
    .m_doc = "The ARC mini-tier's hot paths in C (minisim.MiniTier over ARC is the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__arc_tier(void)
{
    return recency_module(&arc_tier_module, &ARCTierType, "ARCTier");
}
