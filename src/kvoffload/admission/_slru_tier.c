/* The SLRU mini-tier in C: the same decisions as the generic ``minisim.MiniTier`` over
 * ``SLRUCachePolicy``, without the policy object's per-key Python.
 *
 * Under ``--policy slru`` the optimiser's what-if mini-tiers (and the sampled 1x ones that
 * give its 1x figures there) are SLRU tiers. The held keys are a bounded recency table
 * (``_recency.h``) whose own list is the probation segment; the protected segment is a
 * second list over the same nodes, kept to ``protected_limit`` keys by demoting its least
 * recent back to probation. The store and prefix reads are the touch-counting tiers'
 * shared ones (``_pending_tier.h``).
 *
 * Every operation mirrors the generic tier step by step; ``tests/admission/
 * test_minisim_fast.py`` holds the two equal.
 */
#include "_pending_tier.h"

#define IN_SEGMENT POLICY_FLAG  /* in the protected segment (else on probation) */

typedef struct {
    PendingTier tier;
    Py_ssize_t segment_oldest, segment_newest, segment_len;
    Py_ssize_t protected_limit;
} SLRUTier;

/* ``SLRUCachePolicy.evict``: the first unprotected keys of probation, then of the
 * protected segment, each from its least recent end. */
static int
evict(PendingTier *tier, Py_ssize_t n)
{
    SLRUTier *self = (SLRUTier *)tier;
    Recency *r = &tier->r;
    Py_ssize_t node = r->oldest;
    while (n && node != NONE) {
        Py_ssize_t after = r->next[node];
        if (!(tier->flags[node] & PROTECTED)) {
            recency_remove(r, node);
            n--;
        }
        node = after;
    }
    node = self->segment_oldest;
    while (n && node != NONE) {
        Py_ssize_t after = r->next[node];
        if (!(tier->flags[node] & PROTECTED)) {
            list_unlink(r, &self->segment_oldest, &self->segment_newest, node);
            self->segment_len--;
            recency_forget(r, node);
            n--;
        }
        node = after;
    }
    return 0;
}

/* ``SLRUCachePolicy.touch``, the last key first: a protected key becomes the segment's
 * most recent, a settled probation key joins it, a pending one becomes probation's most
 * recent; then the segment's least recent keys go back to probation's recent end while it
 * holds more than its limit. */
static int
touch(PendingTier *tier, PyObject **keys, Py_ssize_t n)
{
    SLRUTier *self = (SLRUTier *)tier;
    Recency *r = &tier->r;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        Py_ssize_t node = recency_find(r, keys[i], NULL);
        if (node == LOOKUP_FAILED) {
            return -1;
        }
        if (node == NONE) {
            continue;
        }
        if (tier->flags[node] & IN_SEGMENT) {
            list_unlink(r, &self->segment_oldest, &self->segment_newest, node);
            list_append(r, &self->segment_oldest, &self->segment_newest, node);
        } else if (tier->flags[node] & FRESH) {
            recency_make_newest(r, node);
        } else {
            recency_unlink(r, node);
            list_append(r, &self->segment_oldest, &self->segment_newest, node);
            self->segment_len++;
            tier->flags[node] |= IN_SEGMENT;
        }
    }
    while (self->segment_len > self->protected_limit) {
        Py_ssize_t node = self->segment_oldest;
        list_unlink(r, &self->segment_oldest, &self->segment_newest, node);
        self->segment_len--;
        tier->flags[node] &= (unsigned char)~IN_SEGMENT;
        recency_append(r, node);
    }
    return 0;
}

static const PendingTierPolicy slru_policy = {evict, NULL, NULL, touch};

static PyObject *
tier_memory_bytes(SLRUTier *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(recency_bytes(&self->tier.r) + self->tier.r.capacity);
}

static int
tier_traverse(SLRUTier *self, visitproc visit, void *arg)
{
    return pending_tier_traverse(&self->tier, visit, arg);
}

static void
tier_empty(PyObject *op)
{
    SLRUTier *self = (SLRUTier *)op;
    self->segment_oldest = self->segment_newest = NONE;
    self->segment_len = 0;
    pending_tier_empty(&self->tier);
}

static int
tier_clear(SLRUTier *self)
{
    return recency_object_clear((PyObject *)self, tier_empty);
}

static void
tier_dealloc(SLRUTier *self)
{
    PyObject_GC_UnTrack(self);
    pending_tier_free(&self->tier);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
tier_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"capacity", "pending", "protected_limit", NULL};
    Py_ssize_t capacity, protected_limit;
    int pending;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "npn:SLRUTier", names, &capacity, &pending,
                                     &protected_limit)) {
        return NULL;
    }
    if (!recency_capacity_ok(capacity, "mini-tier")) {
        return NULL;
    }
    if (protected_limit < 1) {
        recency_invalid("SLRU needs protected_limit >= 1");
        return NULL;
    }
    SLRUTier *self = (SLRUTier *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->segment_oldest = self->segment_newest = NONE;
    self->protected_limit = protected_limit;
    if (pending_tier_init(&self->tier, capacity, pending, &slru_policy) < 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static PyMemberDef tier_members[] = {
    MINI_TIER_COUNTERS,
    {"protected_limit", T_PYSSIZET, offsetof(SLRUTier, protected_limit), READONLY,
     "Keys the protected segment holds at most."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef tier_getset[] = {
    PENDING_TIER_GETTERS,
    {"memory_bytes", (getter)tier_memory_bytes, NULL, "Bytes of the tier's arrays.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SLRUTierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.admission._slru_tier.SLRUTier",
    .tp_basicsize = sizeof(SLRUTier),
    .tp_dealloc = (destructor)tier_dealloc,
    .tp_as_sequence = &recency_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "SLRUTier(capacity, pending, protected_limit)\n--\n\nAn SLRU mini-tier of capacity keys (no data): the generic tier's decisions in C.",
    .tp_traverse = (traverseproc)tier_traverse,
    .tp_clear = (inquiry)tier_clear,
    .tp_methods = pending_tier_methods,
    .tp_members = tier_members,
    .tp_getset = tier_getset,
    .tp_new = tier_new,
};

static struct PyModuleDef slru_tier_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload.admission._slru_tier",
    .m_doc = "The SLRU mini-tier's hot paths in C (minisim.MiniTier over SLRU is the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__slru_tier(void)
{
    return recency_module(&slru_tier_module, &SLRUTierType, "SLRUTier");
}
