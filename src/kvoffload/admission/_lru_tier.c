/* The LRU mini-tier in C: the same decisions as ``minisim.LRUMiniTier``, without a
 * Python-level loop per key.
 *
 * The optimiser runs three exact worlds and a dozen sampled mini-tiers beside the real
 * tier, so these few operations (hit run, touch, store with its evictions) are most of
 * its per-reference cost. The tier is a bounded recency table (``_recency.h``) with a
 * flag per node: unreachable (written behind a gap), or protected from the store in
 * progress.
 *
 * Every operation mirrors the pure-Python tier step by step (``minisim.py`` says why
 * each step is there); ``tests/admission/test_minisim_fast.py`` holds the two equal.
 */
#include "_mini_tier.h"

typedef struct {
    MINI_TIER_FIELDS            /* flags per node: DEAD, PROTECTED */
    /* Scratch for one call: a store's new keys (and the offered keys it stores), the keys
     * a candidate admitted, and the nodes a store protected. */
    NewKeys fresh;
    KeySet admitted;
    MarkedNodes guarded;
} LRUTier;

static int
touch_all(LRUTier *self, PyObject **keys, Py_ssize_t n)
{
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        Py_ssize_t node = recency_find(&self->r, keys[i], NULL);
        if (node == LOOKUP_FAILED) {
            return -1;
        }
        if (node != NONE) {
            recency_make_newest(&self->r, node);
        }
    }
    return 0;
}

static void
unprotect(LRUTier *self)
{
    marked_clear(&self->guarded, self->flags, PROTECTED);
}

static Py_ssize_t
protect(LRUTier *self, PyObject **keys, Py_ssize_t n)
{
    return protect_held(&self->r, self->flags, &self->guarded, keys, n);
}

/* Whether ``args`` are a call's ``min`` to ``max`` positional arguments and no keywords;
 * then ``given`` holds them (borrowed, as "O" gives them; the rest left as they are). The
 * store methods run several times per request, and PyArg_ParseTupleAndKeywords costs about
 * a thousand instructions a call: it parses only the calls with keywords or odd counts. */
static inline int
positional_args(PyObject *args, PyObject *kwargs, Py_ssize_t min, Py_ssize_t max, PyObject **given)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (kwargs != NULL || n < min || n > max) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        given[i] = PyTuple_GET_ITEM(args, i);
    }
    return 1;
}

/* Write the scratch's new keys, evicting the oldest keys outside ``keys`` (or outside
 * ``request`` where enough others are held); see ``LRUMiniTier._insert``. */
static Py_ssize_t
insert_new(LRUTier *self, PyObject **keys, Py_ssize_t n, PyObject **request, Py_ssize_t n_request)
{
    Py_ssize_t need = self->fresh.keys.len - (self->r.capacity - self->r.size);
    if (need > 0) {
        if (n_request && self->r.size - n_request >= need) {
            if (protect(self, request, n_request) < 0) {
                unprotect(self);
                return -1;
            }
        } else {
            if (n_request && touch_all(self, request, n_request) < 0) {
                return -1;
            }
            Py_ssize_t held = protect(self, keys, n);
            if (held < 0 || self->r.size - held < need) {
                unprotect(self);
                return held < 0 ? -1 : 0;
            }
        }
        Py_ssize_t node = self->r.oldest;
        while (need) {
            Py_ssize_t after = self->r.next[node];
            if (!(self->flags[node] & PROTECTED)) {
                self->flags[node] = 0;
                recency_remove(&self->r, node);
                need--;
            }
            node = after;
        }
        unprotect(self);
    }
    for (Py_ssize_t i = 0; i < self->fresh.keys.len; i++) {
        Py_ssize_t node = recency_add(&self->r, self->fresh.keys.key[i], self->fresh.keys.hash[i]);
        if (node < 0) {
            return -1;
        }
        self->flags[node] = self->fresh.dead[i];
    }
    Py_ssize_t written = self->fresh.keys.len;
    self->fresh.keys.len = 0;
    self->writes += (double)written;
    self->total_writes += written;
    return written;
}

static PyObject *
tier_store_impl(LRUTier *self, PyObject *keys, PyObject *behind_gap, PyObject *request)
{
    HeldItems keys_held, gap_held, request_held;
    held_none(&keys_held);
    held_none(&gap_held);
    held_none(&request_held);
    PyObject **key_items, **gap_items, **request_items;
    Py_ssize_t n, n_gap, n_request;
    Py_ssize_t written = -1;
    if (as_items(&keys_held, keys, "keys must be a sequence", &key_items, &n) < 0 ||
        as_items(&gap_held, behind_gap, "behind_gap must be a sequence", &gap_items, &n_gap) < 0 ||
        as_items(&request_held, request, "request must be a sequence", &request_items, &n_request) < 0) {
        goto done;
    }
    if (n_gap && n_gap != n) {
        PyErr_SetString(PyExc_ValueError, "keys and behind_gap differ in length");
        goto done;
    }
    if (new_keys_reset(&self->fresh, n) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int gap = 0;
        if (n_gap && (gap = PyObject_IsTrue(gap_items[i])) < 0) {
            goto done;
        }
        Py_hash_t hash;
        Py_ssize_t node = recency_find(&self->r, key_items[i], &hash);
        if (node == LOOKUP_FAILED || take_key(&self->fresh, self->flags, key_items[i], hash, node, gap) < 0) {
            goto done;
        }
    }
    written = self->fresh.keys.len ? insert_new(self, key_items, n, request_items, n_request) : 0;
done:
    self->fresh.keys.len = 0;
    held_release(&keys_held);
    held_release(&gap_held);
    held_release(&request_held);
    return written < 0 ? NULL : PyLong_FromSsize_t(written);
}

static PyObject *
tier_store(LRUTier *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"keys", "behind_gap", "request", NULL};
    PyObject *given[3] = {NULL, NULL, NULL};
    if (!positional_args(args, kwargs, 1, 3, given) &&
        !PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO:store", names, &given[0], &given[1], &given[2])) {
        return NULL;
    }
    return tier_store_impl(self, given[0], given[1], given[2]);
}

static PyObject *
tier_store_admitted(LRUTier *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"keys", "at", "keep", "gap", "request", NULL};
    PyObject *given[5] = {NULL, NULL, NULL, NULL, NULL};
    Py_ssize_t gap;
    if (positional_args(args, kwargs, 4, 5, given) && PyLong_CheckExact(given[3])) {
        gap = PyLong_AsSsize_t(given[3]);  /* "n"'s conversion of an int, the same error */
        if (gap == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    else if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOn|O:store_admitted", names, &given[0], &given[1],
                                          &given[2], &gap, &given[4])) {
        return NULL;
    }
    PyObject *keys = given[0], *at = given[1], *keep = given[2], *request = given[4];
    if (keep == Py_None) {
        return tier_store_impl(self, keys, NULL, request);
    }
    HeldItems keys_held, at_held, request_held;
    held_none(&keys_held);
    held_none(&at_held);
    held_none(&request_held);
    PyObject **key_items, **at_items, **request_items;
    Py_ssize_t n, n_at, n_request, n_stored = 0;
    Py_ssize_t written = -1;
    if (as_items(&keys_held, keys, "keys must be a sequence", &key_items, &n) < 0 ||
        as_items(&at_held, at, "at must be a sequence", &at_items, &n_at) < 0 ||
        as_items(&request_held, request, "request must be a sequence", &request_items, &n_request) < 0) {
        goto done;
    }
    if (n_at != n) {
        PyErr_SetString(PyExc_ValueError, "keys and at differ in length");
        goto done;
    }
    if (new_keys_reset(&self->fresh, n) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t j;
        int stored_here = admitted_stored(at_items[i], keep, key_items[i], &j);
        if (stored_here < 0) {
            goto done;
        }
        if (!stored_here) {
            continue;
        }
        self->fresh.stored[n_stored++] = key_items[i];
        Py_hash_t hash;
        Py_ssize_t node = recency_find(&self->r, key_items[i], &hash);
        if (node == LOOKUP_FAILED || take_key(&self->fresh, self->flags, key_items[i], hash, node, j > gap) < 0) {
            goto done;
        }
    }
    written = self->fresh.keys.len ? insert_new(self, self->fresh.stored, n_stored, request_items, n_request) : 0;
done:
    self->fresh.keys.len = 0;
    held_release(&keys_held);
    held_release(&at_held);
    held_release(&request_held);
    return written < 0 ? NULL : PyLong_FromSsize_t(written);
}

/* store_admitted(offered, range(len(offered)), *admitted_set(offered, admitted), request)
 * in one call: a candidate's admitted part of an offer, each key behind the gap past
 * the first offered key left out (see minisim.admitted_set for the gap's rule). */
static PyObject *
tier_store_offer(LRUTier *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"offered", "admitted", "request", NULL};
    PyObject *given[3] = {NULL, NULL, NULL};
    if (!positional_args(args, kwargs, 2, 3, given) &&
        !PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:store_offer", names, &given[0], &given[1], &given[2])) {
        return NULL;
    }
    PyObject *offered = given[0], *admitted = given[1], *request = given[2];
    if (admitted == Py_None) {
        return tier_store_impl(self, offered, NULL, request);
    }
    HeldItems offered_held, admitted_held, request_held;
    held_none(&offered_held);
    held_none(&admitted_held);
    held_none(&request_held);
    PyObject **offered_items, **admitted_items, **request_items;
    Py_ssize_t n, m, n_request, n_stored = 0;
    Py_ssize_t written = -1;
    if (as_items(&offered_held, offered, "offered must be a sequence", &offered_items, &n) < 0 ||
        as_items(&admitted_held, admitted, "admitted must be a sequence", &admitted_items, &m) < 0 ||
        as_items(&request_held, request, "request must be a sequence", &request_items, &n_request) < 0) {
        goto done;
    }
    if (m == n) {
        held_release(&offered_held);
        held_release(&admitted_held);
        held_release(&request_held);
        return tier_store_impl(self, offered, NULL, request);
    }
    Py_ssize_t gap = m;
    for (Py_ssize_t i = 0; i < n && i < m; i++) {
        int eq = recency_keys_equal(offered_items[i], admitted_items[i]);
        if (eq < 0) {
            goto done;
        }
        if (!eq) {
            gap = i;
            break;
        }
    }
    if (keyset_reset(&self->admitted, m) < 0 || new_keys_reset(&self->fresh, n) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_hash_t hash = PyObject_Hash(admitted_items[i]);
        if (hash == -1 || keyset_add(&self->admitted, admitted_items[i], hash) < 0) {
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_hash_t hash;
        Py_ssize_t node = recency_find(&self->r, offered_items[i], &hash);
        if (node == LOOKUP_FAILED) {
            goto done;
        }
        int kept = keyset_has(&self->admitted, offered_items[i], hash);
        if (kept < 0) {
            goto done;
        }
        if (!kept) {
            continue;
        }
        self->fresh.stored[n_stored++] = offered_items[i];
        if (take_key(&self->fresh, self->flags, offered_items[i], hash, node, i > gap) < 0) {
            goto done;
        }
    }
    written = self->fresh.keys.len ? insert_new(self, self->fresh.stored, n_stored, request_items, n_request) : 0;
done:
    self->fresh.keys.len = 0;
    self->admitted.len = 0;
    held_release(&offered_held);
    held_release(&admitted_held);
    held_release(&request_held);
    return written < 0 ? NULL : PyLong_FromSsize_t(written);
}

static PyObject *
tier_touch(LRUTier *self, PyObject *keys)
{
    HeldItems held;
    if (held_take(&held, keys, "keys must be a sequence") < 0) {
        return NULL;
    }
    int failed = touch_all(self, held.item, held.len);
    held_release(&held);
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
tier_in_order(LRUTier *self, PyObject *Py_UNUSED(ignored))
{
    return recency_keys(&self->r);
}

static PyObject *
tier_unreachable(LRUTier *self, PyObject *key)
{
    Py_ssize_t node = recency_find(&self->r, key, NULL);
    if (node == LOOKUP_FAILED) {
        return NULL;
    }
    return PyBool_FromLong(node != NONE && (self->flags[node] & DEAD));
}

static void
tier_free_buffers(LRUTier *self)
{
    recency_free(&self->r);
    PyMem_Free(self->flags);
    new_keys_free(&self->fresh);
    keyset_free(&self->admitted);
    PyMem_Free(self->guarded.node);
}

static int
tier_traverse(LRUTier *self, visitproc visit, void *arg)
{
    return recency_traverse(&self->r, visit, arg);
}

static void
tier_empty(PyObject *op)
{
    LRUTier *self = (LRUTier *)op;
    if (self->flags != NULL) {
        memset(self->flags, 0, (size_t)self->r.capacity);
    }
    self->guarded.len = 0;
    recency_clear(&self->r);
}

static int
tier_clear(LRUTier *self)
{
    return recency_object_clear((PyObject *)self, tier_empty);
}

static void
tier_dealloc(LRUTier *self)
{
    PyObject_GC_UnTrack(self);
    tier_free_buffers(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
tier_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"capacity", NULL};
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:LRUTier", names, &capacity)) {
        return NULL;
    }
    if (!recency_capacity_ok(capacity, "mini-tier")) {
        return NULL;
    }
    LRUTier *self = (LRUTier *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->flags = PyMem_Calloc((size_t)capacity, 1);
    if (recency_init(&self->r, capacity) < 0 || self->flags == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

RECENCY_GUARDED(tier_touch)
RECENCY_GUARDED_KW(tier_store)
RECENCY_GUARDED_KW(tier_store_admitted)
RECENCY_GUARDED_KW(tier_store_offer)
RECENCY_GUARDED(tier_in_order)
RECENCY_GUARDED(tier_unreachable)

static PyMethodDef tier_methods[] = {
    MINI_TIER_METHODS,
    {"touch", (PyCFunction)tier_touch_guarded, METH_O, "Make the held keys recent, the first most recent."},
    {"store", (PyCFunction)(void (*)(void))tier_store_guarded, METH_VARARGS | METH_KEYWORDS,
     "store(keys, behind_gap=(), request=()): see LRUMiniTier.store."},
    {"store_admitted", (PyCFunction)(void (*)(void))tier_store_admitted_guarded, METH_VARARGS | METH_KEYWORDS,
     "store_admitted(keys, at, keep, gap, request=()): see LRUMiniTier.store_admitted."},
    {"store_offer", (PyCFunction)(void (*)(void))tier_store_offer_guarded, METH_VARARGS | METH_KEYWORDS,
     "store_offer(offered, admitted, request=()): see LRUMiniTier.store_offer."},
    {"in_order", (PyCFunction)tier_in_order_guarded, METH_NOARGS, "The held keys, least recent first."},
    {"unreachable", (PyCFunction)tier_unreachable_guarded, METH_O, "Whether a held key is behind a gap."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef tier_members[] = {
    MINI_TIER_COUNTERS,
    {NULL, 0, 0, 0, NULL},
};

static PyObject *
tier_memory_bytes(LRUTier *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(recency_bytes(&self->r) + self->r.capacity);
}

static PyGetSetDef tier_getset[] = {
    MINI_TIER_GETTERS,
    {"memory_bytes", (getter)tier_memory_bytes, NULL, "Bytes of the tier's arrays.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LRUTierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.admission._lru_tier.LRUTier",
    .tp_basicsize = sizeof(LRUTier),
    .tp_dealloc = (destructor)tier_dealloc,
    .tp_as_sequence = &recency_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "LRUTier(capacity)\n--\n\nAn LRU mini-tier of capacity keys (no data): LRUMiniTier's decisions in C.",
    .tp_traverse = (traverseproc)tier_traverse,
    .tp_clear = (inquiry)tier_clear,
    .tp_methods = tier_methods,
    .tp_members = tier_members,
    .tp_getset = tier_getset,
    .tp_new = tier_new,
};

static struct PyModuleDef lru_tier_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload.admission._lru_tier",
    .m_doc = "The LRU mini-tier's hot paths in C (minisim.LRUMiniTier is the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__lru_tier(void)
{
    return recency_module(&lru_tier_module, &LRUTierType, "LRUTier");
}
