/* The SIEVE mini-tier in C: the same decisions as the generic ``minisim.MiniTier`` over
 * ``SIEVECachePolicy``, without the policy object's per-key Python.
 *
 * Under ``--policy sieve`` the optimiser's worlds and what-if mini-tiers are SIEVE
 * tiers. The held keys are a bounded recency table (``_recency.h``) whose own list is the
 * queue from the hand on (``unswept``: the hand is its oldest node), with the keys the
 * hand has passed on a second list over the same nodes (``swept``), as the policy keeps
 * two ordered dicts: a survivor keeps its place, and the lists trade roles when the hand
 * wraps. The store, touch and prefix reads are the touch-counting tiers' shared ones
 * (``_pending_tier.h``).
 *
 * Every operation mirrors the generic tier step by step; ``tests/admission/
 * test_minisim_fast.py`` holds the two equal.
 */
#include "_pending_tier.h"

#define VISITED POLICY_FLAG  /* touched since the hand last passed */

typedef struct {
    PendingTier tier;
    Py_ssize_t swept_oldest, swept_newest;
} SIEVETier;

/* The hand's sweep (``SIEVECachePolicy.evict``): a protected key is passed over with its
 * mark, a visited one loses its mark and is passed over, the first other one leaves. */
static int
evict(PendingTier *tier, Py_ssize_t n)
{
    SIEVETier *self = (SIEVETier *)tier;
    Recency *r = &tier->r;
    unsigned char *flags = tier->flags;
    while (n) {
        if (r->oldest == NONE) {
            r->oldest = self->swept_oldest;
            r->newest = self->swept_newest;
            self->swept_oldest = self->swept_newest = NONE;
        }
        Py_ssize_t node = r->oldest;
        recency_unlink(r, node);
        if (flags[node] & PROTECTED) {
            list_append(r, &self->swept_oldest, &self->swept_newest, node);
        } else if (flags[node] & VISITED) {
            flags[node] &= (unsigned char)~VISITED;
            list_append(r, &self->swept_oldest, &self->swept_newest, node);
        } else {
            recency_forget(r, node);
            n--;
        }
    }
    return 0;
}

static void
touched(PendingTier *tier, Py_ssize_t node)
{
    tier->flags[node] |= VISITED;
}

static const PendingTierPolicy sieve_policy = {evict, NULL, touched, NULL};

static PyObject *
tier_memory_bytes(SIEVETier *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(recency_bytes(&self->tier.r) + self->tier.r.capacity);
}

static int
tier_traverse(SIEVETier *self, visitproc visit, void *arg)
{
    return pending_tier_traverse(&self->tier, visit, arg);
}

static void
tier_empty(PyObject *op)
{
    SIEVETier *self = (SIEVETier *)op;
    self->swept_oldest = self->swept_newest = NONE;
    pending_tier_empty(&self->tier);
}

static int
tier_clear(SIEVETier *self)
{
    return recency_object_clear((PyObject *)self, tier_empty);
}

static void
tier_dealloc(SIEVETier *self)
{
    PyObject_GC_UnTrack(self);
    pending_tier_free(&self->tier);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
tier_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"capacity", "pending", NULL};
    Py_ssize_t capacity;
    int pending = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|p:SIEVETier", names, &capacity, &pending)) {
        return NULL;
    }
    if (!recency_capacity_ok(capacity, "mini-tier")) {
        return NULL;
    }
    SIEVETier *self = (SIEVETier *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->swept_oldest = self->swept_newest = NONE;
    if (pending_tier_init(&self->tier, capacity, pending, &sieve_policy) < 0) {
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
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SIEVETierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.admission._sieve_tier.SIEVETier",
    .tp_basicsize = sizeof(SIEVETier),
    .tp_dealloc = (destructor)tier_dealloc,
    .tp_as_sequence = &recency_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "SIEVETier(capacity, pending=True)\n--\n\nA SIEVE mini-tier of capacity keys (no data): the generic tier's decisions in C.",
    .tp_traverse = (traverseproc)tier_traverse,
    .tp_clear = (inquiry)tier_clear,
    .tp_methods = pending_tier_methods,
    .tp_members = tier_members,
    .tp_getset = tier_getset,
    .tp_new = tier_new,
};

static struct PyModuleDef sieve_tier_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload.admission._sieve_tier",
    .m_doc = "The SIEVE mini-tier's hot paths in C (minisim.MiniTier over SIEVE is the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__sieve_tier(void)
{
    return recency_module(&sieve_tier_module, &SIEVETierType, "SIEVETier");
}
