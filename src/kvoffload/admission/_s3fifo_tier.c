/* The S3-FIFO mini-tier in C: the same decisions as ``minisim.S3FIFOMiniTier``, without a
 * Python-level loop per key.
 *
 * Under ``--policy s3fifo`` the optimiser's worlds and what-if mini-tiers are S3-FIFO
 * tiers, and their evictions (a main queue that reinserts a touched key up to three
 * times) were most of its manager time. The held keys are a bounded recency table
 * (``_recency.h``) whose own list is the small queue; the main queue is a second list
 * over the same nodes, and the ghost (keys the small queue evicted) a second table.
 *
 * Every operation mirrors the pure-Python tier step by step (``minisim.py`` says why
 * each step is there); ``tests/admission/test_minisim_fast.py`` holds the two equal.
 */
#include "_mini_tier.h"
#include <structmember.h>

#define IN_MAIN 4u  /* on the main queue (else the small one) */
#define FRESH 8u    /* written by the last store, pending until the touch after it */

typedef struct {
    PyObject_HEAD
    Recency r;                 /* held keys; the table's own list is the small queue */
    Py_ssize_t main_oldest, main_newest, main_len;
    Recency ghost;             /* the small queue's victims, oldest first */
    unsigned char *flags;      /* per node: DEAD, PROTECTED, IN_MAIN, FRESH */
    unsigned char *freq;       /* per node: touches counted, at most max_freq */
    Py_ssize_t small_target;
    int max_freq;
    int pending;
    NewKeys fresh;             /* scratch: a store's new keys */
    MarkedNodes guarded;       /* the nodes a store protected */
    MarkedNodes unsettled;     /* the last store's nodes, while FRESH */
    double hits, writes;
    long long total_hits, total_writes;
} S3FIFOTier;

/* The last store's blocks are written (the Python tier's ``_fresh = ()``). */
static void
settle(S3FIFOTier *self)
{
    marked_clear(&self->unsettled, self->flags, FRESH);
}

/* Remember ``node``'s key among the small queue's victims, the oldest one leaving where
 * the ghost is full (the Python tier trims it to capacity after the eviction loop: the
 * same keys stay, as nothing reads the ghost in between). */
static int
to_ghost(S3FIFOTier *self, Py_ssize_t node)
{
    Recency *ghost = &self->ghost;
    if (ghost->size == ghost->capacity && recency_remove(ghost, ghost->oldest) < 0) {
        return -1;
    }
    return recency_add(ghost, self->r.key[node], self->r.hash[node]) < 0 ? -1 : 0;
}

/* One pass over the small queue (``_from_small``): a protected key goes back, a touched
 * one moves to main with its count reset, the first untouched one leaves for the ghost.
 * 1 if a key left, 0 if none did, -1 on error. */
static int
from_small(S3FIFOTier *self)
{
    Recency *r = &self->r;
    Py_ssize_t rounds = r->size - self->main_len;
    for (Py_ssize_t i = 0; i < rounds; i++) {
        Py_ssize_t node = r->oldest;
        recency_unlink(r, node);
        if (self->flags[node] & PROTECTED) {
            recency_append(r, node);
        } else if (self->freq[node] > 0) {
            self->freq[node] = 0;
            self->flags[node] |= IN_MAIN;
            list_append(r, &self->main_oldest, &self->main_newest, node);
            self->main_len++;
        } else {
            if (to_ghost(self, node) < 0 || recency_forget(r, node) < 0) {
                return -1;
            }
            return 1;
        }
    }
    return 0;
}

/* The main queue's clock (``_from_main``): a protected key goes back, a touched one goes
 * back with one touch less, the first untouched one leaves. 1, 0 or -1 as above. */
static int
from_main(S3FIFOTier *self)
{
    Recency *r = &self->r;
    Py_ssize_t rounds = (self->max_freq + 1) * self->main_len;
    for (Py_ssize_t i = 0; i < rounds; i++) {
        Py_ssize_t node = self->main_oldest;
        list_unlink(r, &self->main_oldest, &self->main_newest, node);
        if (self->flags[node] & PROTECTED) {
            list_append(r, &self->main_oldest, &self->main_newest, node);
        } else if (self->freq[node] > 0) {
            self->freq[node]--;
            list_append(r, &self->main_oldest, &self->main_newest, node);
        } else {
            self->main_len--;
            return recency_forget(r, node) < 0 ? -1 : 1;
        }
    }
    return 0;
}

/* Evict ``n`` unprotected keys (at least ``n`` are held): ``_evict``'s order of queues. */
static int
evict(S3FIFOTier *self, Py_ssize_t n)
{
    while (n) {
        int left;
        if (self->r.size - self->main_len >= self->small_target || self->main_len == 0) {
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

/* Write the new keys gathered in ``fresh`` (``keys``: the whole store, protected), a
 * ghost's key to main and the others to small; how many were written (none where
 * ``keys`` leave too little room), or -1. */
static Py_ssize_t
insert_new(S3FIFOTier *self, PyObject **keys, Py_ssize_t n)
{
    Recency *r = &self->r;
    NewKeys *fresh = &self->fresh;
    Py_ssize_t need = fresh->keys.len - (r->capacity - r->size);
    if (need > 0) {
        /* The distinct held keys of ``keys`` cannot leave: too few others, no write. */
        Py_ssize_t held = protect_held(r, self->flags, &self->guarded, keys, n);
        int outcome = held < 0 ? -1 : r->size - held < need ? 0 : evict(self, need) < 0 ? -1 : 1;
        marked_clear(&self->guarded, self->flags, PROTECTED);
        if (outcome <= 0) {
            return outcome;
        }
    }
    for (Py_ssize_t i = 0; i < fresh->keys.len; i++) {
        PyObject *key = fresh->keys.key[i];
        Py_hash_t hash = fresh->keys.hash[i];
        int found;
        Py_ssize_t slot = recency_slot(&self->ghost, key, hash, &found);
        if (slot < 0 || (found && recency_remove(&self->ghost, self->ghost.table[slot]) < 0)) {
            return -1;
        }
        Py_ssize_t node = recency_add(r, key, hash);
        if (node < 0) {
            return -1;
        }
        self->freq[node] = 0;
        self->flags[node] = fresh->dead[i];
        if (found) {
            recency_unlink(r, node);
            list_append(r, &self->main_oldest, &self->main_newest, node);
            self->main_len++;
            self->flags[node] |= IN_MAIN;
        }
        if (self->pending && marked_add(&self->unsettled, self->flags, node, FRESH) < 0) {
            return -1;
        }
    }
    Py_ssize_t written = fresh->keys.len;
    self->writes += (double)written;
    self->total_writes += written;
    return written;
}

/* ``store`` over ``n`` keys, each behind the gap where ``behind`` (NULL: none) says. */
static Py_ssize_t
store_items(S3FIFOTier *self, PyObject **keys, const unsigned char *behind, Py_ssize_t n)
{
    settle(self);
    if (new_keys_reset(&self->fresh, n) < 0) {
        return -1;
    }
    Py_ssize_t written = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_hash_t hash;
        Py_ssize_t node = recency_find(&self->r, keys[i], &hash);
        if (node == LOOKUP_FAILED ||
            take_key(&self->fresh, self->flags, keys[i], hash, node, behind != NULL && behind[i]) < 0) {
            goto done;
        }
    }
    written = self->fresh.keys.len ? insert_new(self, keys, n) : 0;
done:
    self->fresh.keys.len = 0;
    return written;
}

/* Room for ``n`` gap flags in the scratch's ``dead`` array, which a store's own new keys
 * reuse only after reading them (``store_items`` reads ``behind[i]`` before adding key
 * ``i``, and new keys are never more than the keys read so far). */
static unsigned char *
gap_flags(S3FIFOTier *self, Py_ssize_t n)
{
    return new_keys_reset(&self->fresh, n) < 0 ? NULL : self->fresh.dead;
}

static PyObject *
tier_store(S3FIFOTier *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"keys", "behind_gap", NULL};
    PyObject *keys, *behind_gap = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:store", names, &keys, &behind_gap)) {
        return NULL;
    }
    PyObject *keys_fast = NULL, *gap_fast = NULL;
    PyObject **key_items, **gap_items;
    Py_ssize_t n, n_gap, written = -1;
    unsigned char *behind = NULL;
    if (as_items(keys, "keys must be a sequence", &keys_fast, &key_items, &n) < 0 ||
        as_items(behind_gap, "behind_gap must be a sequence", &gap_fast, &gap_items, &n_gap) < 0) {
        goto done;
    }
    if (n_gap && n_gap != n) {
        PyErr_SetString(PyExc_ValueError, "keys and behind_gap differ in length");
        goto done;
    }
    if (n_gap) {
        if ((behind = gap_flags(self, n)) == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int gap = PyObject_IsTrue(gap_items[i]);
            if (gap < 0) {
                goto done;
            }
            behind[i] = (unsigned char)gap;
        }
    }
    written = store_items(self, key_items, behind, n);
done:
    Py_XDECREF(keys_fast);
    Py_XDECREF(gap_fast);
    return written < 0 ? NULL : PyLong_FromSsize_t(written);
}

/* ``MiniTier.store_admitted``: the keys the real tier served (``at`` -1) and those in
 * ``keep``, each behind the gap past offer index ``gap``; no store at all (so the last
 * store's blocks stay pending) when none is left. */
static PyObject *
tier_store_admitted(S3FIFOTier *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"keys", "at", "keep", "gap", NULL};
    PyObject *keys, *at, *keep;
    Py_ssize_t gap;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOn:store_admitted", names, &keys, &at, &keep, &gap)) {
        return NULL;
    }
    PyObject *keys_fast = NULL, *at_fast = NULL;
    PyObject **key_items, **at_items;
    Py_ssize_t n, n_at, n_stored = 0, written = -1;
    if (as_items(keys, "keys must be a sequence", &keys_fast, &key_items, &n) < 0 ||
        as_items(at, "at must be a sequence", &at_fast, &at_items, &n_at) < 0) {
        goto done;
    }
    if (keep == Py_None) {
        written = store_items(self, key_items, NULL, n);
        goto done;
    }
    if (n_at != n) {
        PyErr_SetString(PyExc_ValueError, "keys and at differ in length");
        goto done;
    }
    unsigned char *behind = gap_flags(self, n);
    if (behind == NULL) {
        goto done;
    }
    PyObject **stored = self->fresh.stored;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t j = PyLong_AsSsize_t(at_items[i]);
        if (j == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (j >= 0) {
            int kept = PySequence_Contains(keep, key_items[i]);
            if (kept < 0) {
                goto done;
            }
            if (!kept) {
                continue;
            }
        }
        behind[n_stored] = (unsigned char)(j > gap);
        stored[n_stored++] = key_items[i];
    }
    written = n_stored ? store_items(self, stored, behind, n_stored) : 0;
done:
    Py_XDECREF(keys_fast);
    Py_XDECREF(at_fast);
    return written < 0 ? NULL : PyLong_FromSsize_t(written);
}

static PyObject *
tier_hit_run(S3FIFOTier *self, PyObject *keys)
{
    Py_ssize_t run = leading_run(&self->r, self->flags, keys, DEAD);
    if (run < 0) {
        return NULL;
    }
    self->hits += (double)run;
    self->total_hits += run;
    return PyLong_FromSsize_t(run);
}

static PyObject *
tier_leading_held(S3FIFOTier *self, PyObject *keys)
{
    Py_ssize_t run = leading_run(&self->r, self->flags, keys, 0);
    return run < 0 ? NULL : PyLong_FromSsize_t(run);
}

static PyObject *
tier_held_among(S3FIFOTier *self, PyObject *keys)
{
    return held_among(&self->r, keys);
}

/* Count a touch of every held key that is not pending, up to ``max_freq``; then the last
 * store's blocks are settled. */
static PyObject *
tier_touch(S3FIFOTier *self, PyObject *keys)
{
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int failed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t node = recency_find(&self->r, items[i], NULL);
        if (node == LOOKUP_FAILED) {
            failed = 1;
            break;
        }
        if (node != NONE && self->freq[node] < self->max_freq && !(self->flags[node] & FRESH)) {
            self->freq[node]++;
        }
    }
    Py_DECREF(fast);
    if (failed) {
        return NULL;
    }
    settle(self);
    Py_RETURN_NONE;
}

static PyObject *
tier_held(S3FIFOTier *self, void *Py_UNUSED(closure))
{
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *
tier_memory_bytes(S3FIFOTier *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(recency_bytes(&self->r) + recency_bytes(&self->ghost) + 2 * self->r.capacity);
}

static PyObject *
tier_pending(S3FIFOTier *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->pending);
}

static void
tier_dealloc(S3FIFOTier *self)
{
    recency_free(&self->r);
    recency_free(&self->ghost);
    PyMem_Free(self->flags);
    PyMem_Free(self->freq);
    new_keys_free(&self->fresh);
    PyMem_Free(self->guarded.node);
    PyMem_Free(self->unsettled.node);
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
    self->pending = pending;
    self->flags = PyMem_Calloc((size_t)capacity, 1);
    self->freq = PyMem_Calloc((size_t)capacity, 1);
    if (recency_init(&self->r, capacity) < 0 || recency_init(&self->ghost, capacity) < 0 ||
        self->flags == NULL || self->freq == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static PyMethodDef tier_methods[] = {
    {"hit_run", (PyCFunction)tier_hit_run, METH_O, "How many leading keys are held and reachable."},
    {"touch", (PyCFunction)tier_touch, METH_O, "Count a touch of each held key that is not pending."},
    {"store", (PyCFunction)(void (*)(void))tier_store, METH_VARARGS | METH_KEYWORDS,
     "store(keys, behind_gap=()): see MiniTier.store."},
    {"store_admitted", (PyCFunction)(void (*)(void))tier_store_admitted, METH_VARARGS | METH_KEYWORDS,
     "store_admitted(keys, at, keep, gap): see MiniTier.store_admitted."},
    {"held_among", (PyCFunction)tier_held_among, METH_O, "The held keys among keys, in order."},
    {"leading_held", (PyCFunction)tier_leading_held, METH_O, "How many leading keys are held."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef tier_members[] = {
    {"hits", T_DOUBLE, offsetof(S3FIFOTier, hits), 0, "Hits, halved with the caller's window."},
    {"writes", T_DOUBLE, offsetof(S3FIFOTier, writes), 0, "Writes, halved with the caller's window."},
    {"total_hits", T_LONGLONG, offsetof(S3FIFOTier, total_hits), 0, "Hits since the start."},
    {"total_writes", T_LONGLONG, offsetof(S3FIFOTier, total_writes), 0, "Writes since the start."},
    {"small_target", T_PYSSIZET, offsetof(S3FIFOTier, small_target), READONLY,
     "Keys the small queue holds before it evicts first."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef tier_getset[] = {
    {"held", (getter)tier_held, NULL, "The tier itself: membership of held keys.", NULL},
    {"capacity", recency_object_capacity, NULL, "Keys the tier holds at most.", NULL},
    {"memory_bytes", (getter)tier_memory_bytes, NULL, "Bytes of the tier's arrays.", NULL},
    {"pending", (getter)tier_pending, NULL, "Whether a store's blocks stay pending until the next touch.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject S3FIFOTierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.admission._s3fifo_tier.S3FIFOTier",
    .tp_basicsize = sizeof(S3FIFOTier),
    .tp_dealloc = (destructor)tier_dealloc,
    .tp_as_sequence = &recency_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "An S3-FIFO mini-tier of capacity keys (no data): S3FIFOMiniTier's decisions in C.",
    .tp_methods = tier_methods,
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
