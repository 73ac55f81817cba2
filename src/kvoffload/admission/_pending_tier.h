/* The compiled mini-tiers of the policies that count touches (ARC, S3-FIFO, SIEVE, SLRU):
 * what they share, after the generic ``MiniTier`` over the policy object (``minisim.py``).
 *
 * A store's blocks stay pending (FRESH) until the next touch or store when ``pending``,
 * a touch counts only for settled blocks, and a store evicts by the policy what its own
 * keys leave room for. The policy comes in through hooks; everything else is here, once.
 */
#ifndef KVOFFLOAD_PENDING_TIER_H
#define KVOFFLOAD_PENDING_TIER_H

#include "_mini_tier.h"

#define FRESH 4u       /* written by the last store, pending until the touch after it */
#define POLICY_FLAG 8u /* the policy's own mark (ARC: in T2; S3-FIFO: on the main queue;
                          SIEVE: visited; SLRU: in the protected segment) */

typedef struct PendingTier PendingTier;

typedef struct {
    /* Evict ``n`` unprotected keys (at least ``n`` are held); 0 or -1. */
    int (*evict)(PendingTier *self, Py_ssize_t n);
    /* A new key's node, just added as the newest on the table's own list; 0 or -1 (NULL:
     * nothing to do). */
    int (*place)(PendingTier *self, Py_ssize_t node);
    /* A touch of a held, settled key (NULL where ``touch`` is given). */
    void (*touched)(PendingTier *self, Py_ssize_t node);
    /* A whole touch of ``n`` keys, before the last store's blocks settle, for a policy
     * that also reads keys it does not hold or pending ones (ARC, SLRU); 0 or -1 (NULL:
     * each held, settled key goes to ``touched``). */
    int (*touch)(PendingTier *self, PyObject **keys, Py_ssize_t n);
} PendingTierPolicy;

struct PendingTier {
    MINI_TIER_FIELDS                 /* flags per node: DEAD, PROTECTED, FRESH, POLICY_FLAG */
    const PendingTierPolicy *policy;
    int pending;
    NewKeys fresh;                   /* scratch: a store's new keys */
    MarkedNodes guarded;             /* the nodes a store protected */
    MarkedNodes unsettled;           /* the last store's nodes, while FRESH */
};

/* 0, or -1 with MemoryError set (the caller then frees with pending_tier_free). */
static inline int
pending_tier_init(PendingTier *self, Py_ssize_t capacity, int pending, const PendingTierPolicy *policy)
{
    self->policy = policy;
    self->pending = pending;
    self->flags = PyMem_Calloc((size_t)capacity, 1);
    if (recency_init(&self->r, capacity) < 0 || self->flags == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static inline void
pending_tier_free(PendingTier *self)
{
    recency_free(&self->r);
    PyMem_Free(self->flags);
    new_keys_free(&self->fresh);
    PyMem_Free(self->guarded.node);
    PyMem_Free(self->unsettled.node);
}

/* Visit the held keys (a type with ghost tables visits those too). */
static inline int
pending_tier_traverse(PendingTier *self, visitproc visit, void *arg)
{
    return recency_traverse(&self->r, visit, arg);
}

/* Hold no key (the collector's clear; a type with ghost tables or lists of its own resets
 * those too). */
static inline void
pending_tier_empty(PendingTier *self)
{
    if (self->flags != NULL) {
        memset(self->flags, 0, (size_t)self->r.capacity);
    }
    self->guarded.len = self->unsettled.len = 0;
    recency_clear(&self->r);
}

/* The last store's blocks are written (the generic tier's ``_settle``). */
static inline void
pending_tier_settle(PendingTier *self)
{
    marked_clear(&self->unsettled, self->flags, FRESH);
}

/* Write the new keys gathered in ``fresh`` (``keys``: the whole store, protected); how
 * many were written (none where ``keys`` leave too little room), or -1. */
static inline Py_ssize_t
pending_tier_insert(PendingTier *self, PyObject **keys, Py_ssize_t n)
{
    Recency *r = &self->r;
    NewKeys *fresh = &self->fresh;
    Py_ssize_t need = fresh->keys.len - (r->capacity - r->size);
    if (need > 0) {
        /* The distinct held keys of ``keys`` cannot leave: too few others, no write. */
        Py_ssize_t held = protect_held(r, self->flags, &self->guarded, keys, n);
        int outcome = held < 0 ? -1 : r->size - held < need ? 0 : self->policy->evict(self, need) < 0 ? -1 : 1;
        marked_clear(&self->guarded, self->flags, PROTECTED);
        if (outcome <= 0) {
            return outcome;
        }
    }
    for (Py_ssize_t i = 0; i < fresh->keys.len; i++) {
        Py_ssize_t node = recency_add(r, fresh->keys.key[i], fresh->keys.hash[i]);
        if (node < 0) {
            return -1;
        }
        self->flags[node] = fresh->dead[i];
        if ((self->policy->place != NULL && self->policy->place(self, node) < 0) ||
            (self->pending && marked_add(&self->unsettled, self->flags, node, FRESH) < 0)) {
            return -1;
        }
    }
    Py_ssize_t written = fresh->keys.len;
    self->writes += (double)written;
    self->total_writes += written;
    return written;
}

/* Remember held ``node``'s key in ``ghost`` (a table of evicted keys, oldest first), its
 * oldest key leaving where it is full. The policies trim a ghost to its capacity after the
 * whole eviction loop; the same keys stay, as nothing reads a ghost in between. */
static inline int
ghost_remember(PendingTier *self, Recency *ghost, Py_ssize_t node)
{
    if (ghost->size == ghost->capacity) {
        recency_remove(ghost, ghost->oldest);
    }
    return recency_add(ghost, self->r.key[node], self->r.hash[node]) < 0 ? -1 : 0;
}

/* Forget held ``node``'s key in ``ghost``: 1 if it was there, 0 if not, -1 on error. */
static inline int
ghost_forget(PendingTier *self, Recency *ghost, Py_ssize_t node)
{
    if (ghost->size == 0) {
        return 0;
    }
    int found;
    Py_ssize_t slot = recency_slot(ghost, self->r.key[node], self->r.hash[node], &found);
    if (slot < 0) {
        return -1;
    }
    if (found) {
        recency_remove(ghost, ghost->table[slot]);
    }
    return found;
}

/* ``store`` over ``n`` keys, each behind the gap where ``behind`` (NULL: none) says. */
static inline Py_ssize_t
pending_tier_store_items(PendingTier *self, PyObject **keys, const unsigned char *behind, Py_ssize_t n)
{
    pending_tier_settle(self);
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
    written = self->fresh.keys.len ? pending_tier_insert(self, keys, n) : 0;
done:
    self->fresh.keys.len = 0;
    return written;
}

/* Room for ``n`` gap flags in the scratch's ``dead`` array, which a store's own new keys
 * reuse only after reading them (``pending_tier_store_items`` reads ``behind[i]`` before
 * adding key ``i``, and new keys are never more than the keys read so far). */
static inline unsigned char *
pending_tier_gap_flags(PendingTier *self, Py_ssize_t n)
{
    return new_keys_reset(&self->fresh, n) < 0 ? NULL : self->fresh.dead;
}

static PyObject *
pending_tier_store(PendingTier *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"keys", "behind_gap", NULL};
    PyObject *keys, *behind_gap = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:store", names, &keys, &behind_gap)) {
        return NULL;
    }
    HeldItems keys_held, gap_held;
    held_none(&keys_held);
    held_none(&gap_held);
    PyObject **key_items, **gap_items;
    Py_ssize_t n, n_gap, written = -1;
    unsigned char *behind = NULL;
    if (as_items(&keys_held, keys, "keys must be a sequence", &key_items, &n) < 0 ||
        as_items(&gap_held, behind_gap, "behind_gap must be a sequence", &gap_items, &n_gap) < 0) {
        goto done;
    }
    if (n_gap && n_gap != n) {
        PyErr_SetString(PyExc_ValueError, "keys and behind_gap differ in length");
        goto done;
    }
    if (n_gap) {
        if ((behind = pending_tier_gap_flags(self, n)) == NULL) {
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
    written = pending_tier_store_items(self, key_items, behind, n);
done:
    held_release(&keys_held);
    held_release(&gap_held);
    return written < 0 ? NULL : PyLong_FromSsize_t(written);
}

/* ``MiniTier.store_admitted``: the keys the real tier served (``at`` -1) and those in
 * ``keep``, each behind the gap past offer index ``gap``; no store at all (so the last
 * store's blocks stay pending) when none is left. */
static PyObject *
pending_tier_store_admitted(PendingTier *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"keys", "at", "keep", "gap", NULL};
    PyObject *keys, *at, *keep;
    Py_ssize_t gap;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOn:store_admitted", names, &keys, &at, &keep, &gap)) {
        return NULL;
    }
    HeldItems keys_held, at_held;
    held_none(&keys_held);
    held_none(&at_held);
    PyObject **key_items, **at_items;
    Py_ssize_t n, n_at, n_stored = 0, written = -1;
    if (as_items(&keys_held, keys, "keys must be a sequence", &key_items, &n) < 0 ||
        as_items(&at_held, at, "at must be a sequence", &at_items, &n_at) < 0) {
        goto done;
    }
    if (keep == Py_None) {
        written = pending_tier_store_items(self, key_items, NULL, n);
        goto done;
    }
    if (n_at != n) {
        PyErr_SetString(PyExc_ValueError, "keys and at differ in length");
        goto done;
    }
    unsigned char *behind = pending_tier_gap_flags(self, n);
    if (behind == NULL) {
        goto done;
    }
    PyObject **stored = self->fresh.stored;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t j;
        int stored_here = admitted_stored(at_items[i], keep, key_items[i], &j);
        if (stored_here < 0) {
            goto done;
        }
        if (!stored_here) {
            continue;
        }
        behind[n_stored] = (unsigned char)(j > gap);
        stored[n_stored++] = key_items[i];
    }
    written = n_stored ? pending_tier_store_items(self, stored, behind, n_stored) : 0;
done:
    held_release(&keys_held);
    held_release(&at_held);
    return written < 0 ? NULL : PyLong_FromSsize_t(written);
}

/* Count a touch of every held key that is not pending; then the last store's blocks are
 * settled. */
static PyObject *
pending_tier_touch(PendingTier *self, PyObject *keys)
{
    HeldItems held;
    if (held_take(&held, keys, "keys must be a sequence") < 0) {
        return NULL;
    }
    PyObject **items = held.item;
    Py_ssize_t n = held.len;
    int failed = 0;
    if (self->policy->touch != NULL) {
        failed = self->policy->touch(self, items, n) < 0;
    }
    for (Py_ssize_t i = 0; self->policy->touch == NULL && i < n; i++) {
        Py_ssize_t node = recency_find(&self->r, items[i], NULL);
        if (node == LOOKUP_FAILED) {
            failed = 1;
            break;
        }
        if (node != NONE && !(self->flags[node] & FRESH)) {
            self->policy->touched(self, node);
        }
    }
    held_release(&held);
    if (failed) {
        return NULL;
    }
    pending_tier_settle(self);
    Py_RETURN_NONE;
}

static PyObject *
pending_tier_pending(PendingTier *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->pending);
}

RECENCY_GUARDED(pending_tier_touch)
RECENCY_GUARDED_KW(pending_tier_store)
RECENCY_GUARDED_KW(pending_tier_store_admitted)

static PyMethodDef pending_tier_methods[] = {
    MINI_TIER_METHODS,
    {"touch", (PyCFunction)pending_tier_touch_guarded, METH_O, "Count a touch of each held key that is not pending."},
    {"store", (PyCFunction)(void (*)(void))pending_tier_store_guarded, METH_VARARGS | METH_KEYWORDS,
     "store(keys, behind_gap=()): see MiniTier.store."},
    {"store_admitted", (PyCFunction)(void (*)(void))pending_tier_store_admitted_guarded, METH_VARARGS | METH_KEYWORDS,
     "store_admitted(keys, at, keep, gap): see MiniTier.store_admitted."},
    {NULL, NULL, 0, NULL},
};

/* The getters every such type shares, before its own ``memory_bytes``. */
#define PENDING_TIER_GETTERS \
    MINI_TIER_GETTERS,       \
    {"pending", (getter)pending_tier_pending, NULL, "Whether a store's blocks stay pending until the next touch.", NULL}

#endif
