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

#define DEAD 1u       /* written behind a gap: unreachable by a prefix lookup */
#define PROTECTED 2u  /* may not be evicted by the store in progress */

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

/* A sequence argument as a borrowed item array (``*holder`` owns it; NULL for absent). */
static inline int
as_items(PyObject *arg, const char *what, PyObject **holder, PyObject ***items, Py_ssize_t *n)
{
    *holder = NULL;
    *items = NULL;
    *n = 0;
    if (arg == NULL) {
        return 0;
    }
    PyObject *fast = PySequence_Fast(arg, what);
    if (fast == NULL) {
        return -1;
    }
    *holder = fast;
    *items = PySequence_Fast_ITEMS(fast);
    *n = PySequence_Fast_GET_SIZE(fast);
    return 0;
}

/* How many leading ``keys`` are held and have none of ``stop`` (DEAD: reachable by a
 * prefix lookup; 0: held at all), or -1 with an exception set. */
static inline Py_ssize_t
leading_run(Recency *r, const unsigned char *flags, PyObject *keys, unsigned char stop)
{
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (fast == NULL) {
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), run = 0;
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
    Py_DECREF(fast);
    return run;
}

/* The held keys (reachable or not) among ``keys``, in order, as a new list. */
static inline PyObject *
held_among(Recency *r, PyObject *keys)
{
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *result = PyList_New(0);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        Py_ssize_t node = recency_find(r, items[i], NULL);
        if (node == LOOKUP_FAILED || (node != NONE && PyList_Append(result, items[i]) < 0)) {
            Py_CLEAR(result);
        }
    }
    Py_DECREF(fast);
    return result;
}

#endif
