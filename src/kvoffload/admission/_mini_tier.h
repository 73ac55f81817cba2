/* What the compiled mini-tiers (LRU, S3-FIFO) share: a flag per node, a store's new keys,
 * the protection of a store's own keys, and the prefix reads.
 *
 * Each mini-tier mirrors its pure-Python twin in ``minisim.py``; these are the steps the
 * twins share (``MiniTier.store``'s gap and revival rules, ``hit_run``, ``leading_held``,
 * ``held_among``), written once.
 */
#ifndef KVOFFLOAD_MINI_TIER_H
#define KVOFFLOAD_MINI_TIER_H

#include "_recency.h"
#include <structmember.h>

#define DEAD 1u       /* written behind a gap: unreachable by a prefix lookup */
#define PROTECTED 2u  /* may not be evicted by the store in progress */

/* The fields every compiled mini-tier starts with, in this order, so that a pointer to any
 * of them is a pointer to a MiniTierObject (the initial-sequence idiom of PyObject_HEAD
 * itself): the held keys (first, as RecencyObject's), a flag per node, and the counters. */
#define MINI_TIER_FIELDS          \
    RECENCY_OBJECT_FIELDS         \
    unsigned char *flags;         \
    double hits, writes;          \
    long long total_hits, total_writes;

typedef struct {
    MINI_TIER_FIELDS
} MiniTierObject;

/* A store's distinct new keys in order (borrowed), each with its unreachable mark, and
 * room for the keys it stores (``stored``), all grown once and reused. */
typedef struct {
    KeySet keys;
    unsigned char *dead;
    PyObject **stored;
    Py_ssize_t extra_cap;  /* items in ``dead`` and ``stored`` */
} NewKeys;

/* Empty ``new`` with room for a store of ``n`` keys; 0 or -1. */
static inline int
new_keys_reset(NewKeys *new, Py_ssize_t n)
{
    if (keyset_reset(&new->keys, n) < 0) {
        return -1;
    }
    Py_ssize_t cap = new->keys.cap;
    if (new->extra_cap < cap) {
        if (recency_grow((void **)&new->dead, cap, 1) < 0 ||
            recency_grow((void **)&new->stored, cap, sizeof(PyObject *)) < 0) {
            return -1;
        }
        new->extra_cap = cap;
    }
    return 0;
}

static inline void
new_keys_free(NewKeys *new)
{
    keyset_free(&new->keys);
    PyMem_Free(new->dead);
    PyMem_Free(new->stored);
    memset(new, 0, sizeof(*new));
}

/* One key a store writes (its hash and node known): a new key joins ``new`` unless already
 * there (the Python dict's first-wins), behind the gap or not; a held one behind a gap is
 * revived unless this store puts it behind one too. 0, or -1 on error. */
static inline int
take_key(NewKeys *new, unsigned char *flags, PyObject *key, Py_hash_t hash, Py_ssize_t node, int behind)
{
    if (node == NONE) {
        int added = keyset_add(&new->keys, key, hash);
        if (added > 0) {
            new->dead[new->keys.len - 1] = (unsigned char)(behind ? DEAD : 0);
        }
        return added < 0 ? -1 : 0;
    }
    if ((flags[node] & DEAD) && !behind) {
        flags[node] &= (unsigned char)~DEAD;
    }
    return 0;
}

/* Mark the held keys among ``keys`` protected; how many distinct ones, or -1 (the caller
 * clears the marks with ``marked_clear`` either way). */
static inline Py_ssize_t
protect_held(Recency *r, unsigned char *flags, MarkedNodes *guarded, PyObject **keys, Py_ssize_t n)
{
    Py_ssize_t marked = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t node = recency_find(r, keys[i], NULL);
        if (node == LOOKUP_FAILED) {
            return -1;
        }
        if (node != NONE) {
            int added = marked_add(guarded, flags, node, PROTECTED);
            if (added < 0) {
                return -1;
            }
            marked += added;
        }
    }
    return marked;
}

/* Whether ``store_admitted`` stores ``key``: the real tier served it (``at_item`` -1) or
 * ``keep`` holds it; its offer index goes to ``*at``. 1, 0, or -1 with an exception set. */
static inline int
admitted_stored(PyObject *at_item, PyObject *keep, PyObject *key, Py_ssize_t *at)
{
    Py_ssize_t j = PyLong_AsSsize_t(at_item);
    if (j == -1 && PyErr_Occurred()) {
        return -1;
    }
    *at = j;
    return j < 0 ? 1 : PySequence_Contains(keep, key);
}

/* ``held_take`` of an argument (NULL: not given), its items as an array and a length. */
static inline int
as_items(HeldItems *held, PyObject *arg, const char *what, PyObject ***items, Py_ssize_t *n)
{
    int failed = held_take(held, arg, what);
    *items = held->item;
    *n = held->len;
    return failed;
}

/* How many leading ``keys`` are held and have none of ``stop`` (DEAD: reachable by a
 * prefix lookup; 0: held at all), or -1 with an exception set. */
static inline Py_ssize_t
leading_run(Recency *r, const unsigned char *flags, PyObject *keys, unsigned char stop)
{
    HeldItems held;
    if (held_take(&held, keys, "keys must be a sequence") < 0) {
        return -1;
    }
    PyObject **items = held.item;
    Py_ssize_t n = held.len, run = 0;
    for (; run < n; run++) {
        Py_ssize_t node = recency_find(r, items[run], NULL);
        if (node == LOOKUP_FAILED) {
            run = -1;
            break;
        }
        if (node == NONE || (flags[node] & stop)) {
            break;
        }
    }
    held_release(&held);
    return run;
}

/* The held keys (reachable or not) among ``keys``, in order, as a new list. */
static inline PyObject *
held_among(Recency *r, PyObject *keys)
{
    HeldItems held;
    if (held_take(&held, keys, "keys must be a sequence") < 0) {
        return NULL;
    }
    PyObject **items = held.item;
    Py_ssize_t n = held.len;
    PyObject *result = PyList_New(0);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        Py_ssize_t node = recency_find(r, items[i], NULL);
        if (node == LOOKUP_FAILED || (node != NONE && PyList_Append(result, items[i]) < 0)) {
            Py_CLEAR(result);
        }
    }
    held_release(&held);
    return result;
}

static PyObject *
mini_tier_hit_run(MiniTierObject *self, PyObject *keys)
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
mini_tier_leading_held(MiniTierObject *self, PyObject *keys)
{
    Py_ssize_t run = leading_run(&self->r, self->flags, keys, 0);
    return run < 0 ? NULL : PyLong_FromSsize_t(run);
}

static PyObject *
mini_tier_held_among(MiniTierObject *self, PyObject *keys)
{
    return held_among(&self->r, keys);
}

RECENCY_GUARDED(mini_tier_hit_run)
RECENCY_GUARDED(mini_tier_leading_held)
RECENCY_GUARDED(mini_tier_held_among)

static PyObject *
mini_tier_held(MiniTierObject *self, void *Py_UNUSED(closure))
{
    Py_INCREF(self);
    return (PyObject *)self;
}

/* The method-table entries, members and getters every mini-tier type shares. */
#define MINI_TIER_METHODS                                                                          \
    {"hit_run", (PyCFunction)mini_tier_hit_run_guarded, METH_O, "How many leading keys are held and reachable."}, \
    {"held_among", (PyCFunction)mini_tier_held_among_guarded, METH_O, "The held keys among keys, in order."},    \
    {"leading_held", (PyCFunction)mini_tier_leading_held_guarded, METH_O, "How many leading keys are held."}

#define MINI_TIER_COUNTERS                                                                           \
    {"hits", T_DOUBLE, offsetof(MiniTierObject, hits), 0, "Hits, halved with the caller's window."},       \
    {"writes", T_DOUBLE, offsetof(MiniTierObject, writes), 0, "Writes, halved with the caller's window."}, \
    {"total_hits", T_LONGLONG, offsetof(MiniTierObject, total_hits), 0, "Hits since the start."},          \
    {"total_writes", T_LONGLONG, offsetof(MiniTierObject, total_writes), 0, "Writes since the start."}

#define MINI_TIER_GETTERS                                                                     \
    {"held", (getter)mini_tier_held, NULL, "The tier itself: membership of held keys.", NULL}, \
    {"capacity", recency_object_capacity, NULL, "Keys the tier holds at most.", NULL}

#endif
