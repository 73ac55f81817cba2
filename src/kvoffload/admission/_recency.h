/* A bounded recency table of Python keys, shared by the compiled admission modules.
 *
 * A fixed pool of ``capacity`` nodes on a doubly linked list (oldest first) and an
 * open-addressing table of node indices (linear probing, backward-shift deletion, so no
 * tombstones build up; at most half full). Keys are held by reference and compared as
 * Python objects (bytes in practice, compared directly). Everything is static: each
 * module that includes this header gets its own copy.
 */
#ifndef KVOFFLOAD_RECENCY_H
#define KVOFFLOAD_RECENCY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define NONE (-1)
#define LOOKUP_FAILED (-2)

typedef struct {
    Py_ssize_t capacity;
    Py_ssize_t size;
    size_t mask;             /* table slots - 1 */
    Py_ssize_t *table;       /* node index per slot, or NONE */
    PyObject **key;
    Py_hash_t *hash;
    Py_ssize_t *prev, *next; /* the recency list; ``next`` also chains free nodes */
    Py_ssize_t oldest, newest, free_list;
} Recency;

static inline int
recency_keys_equal(PyObject *a, PyObject *b)
{
    if (a == b) {
        return 1;
    }
    if (PyBytes_CheckExact(a) && PyBytes_CheckExact(b)) {
        Py_ssize_t n = PyBytes_GET_SIZE(a);
        return n == PyBytes_GET_SIZE(b) && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)n) == 0;
    }
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

static inline size_t
recency_spread(Py_hash_t hash)
{
    uint64_t h = (uint64_t)hash;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return (size_t)h;
}

/* No key held: every slot empty, every node free (the keys' references are the caller's). */
static inline void
recency_reset(Recency *r)
{
    r->size = 0;
    r->oldest = r->newest = NONE;
    memset(r->table, 0xff, (r->mask + 1) * sizeof(Py_ssize_t));
    for (Py_ssize_t node = 0; node < r->capacity; node++) {
        r->next[node] = node + 1 < r->capacity ? node + 1 : NONE;
    }
    r->free_list = 0;
}

/* 0, or -1 with MemoryError set (the caller then frees with recency_free). */
static inline int
recency_init(Recency *r, Py_ssize_t capacity)
{
    size_t slots = 8;
    while (slots < (size_t)capacity * 2) {
        slots <<= 1;
    }
    r->capacity = capacity;
    r->mask = slots - 1;
    r->table = PyMem_Malloc(slots * sizeof(Py_ssize_t));
    r->key = PyMem_Calloc((size_t)capacity, sizeof(PyObject *));
    r->hash = PyMem_Malloc((size_t)capacity * sizeof(Py_hash_t));
    r->prev = PyMem_Malloc((size_t)capacity * sizeof(Py_ssize_t));
    r->next = PyMem_Malloc((size_t)capacity * sizeof(Py_ssize_t));
    if (!r->table || !r->key || !r->hash || !r->prev || !r->next) {
        PyErr_NoMemory();
        return -1;
    }
    recency_reset(r);
    return 0;
}

static inline void
recency_free(Recency *r)
{
    if (r->key != NULL) {
        /* Every node, not only the list's: a caller may keep held nodes on lists of its
         * own (``list_append``); a free node's key is NULL. */
        for (Py_ssize_t node = 0; node < r->capacity; node++) {
            Py_CLEAR(r->key[node]);
        }
    }
    PyMem_Free(r->table);
    PyMem_Free(r->key);
    PyMem_Free(r->hash);
    PyMem_Free(r->prev);
    PyMem_Free(r->next);
    memset(r, 0, sizeof(*r));
}

/* Visit every key ``r`` holds, for the cyclic garbage collector: a key may be any hashable
 * object, one that refers back to its table too, a cycle that reference counts never free. */
static inline int
recency_traverse(const Recency *r, visitproc visit, void *arg)
{
    for (Py_ssize_t node = 0; r->key != NULL && node < r->capacity; node++) {
        Py_VISIT(r->key[node]);
    }
    return 0;
}

/* Empty ``r`` (the collector's clear): the table is reset first, then the keys released,
 * whose release may run their ``__del__`` (see recency_object_clear). */
static inline void
recency_clear(Recency *r)
{
    if (!r->table || !r->key || !r->hash || !r->prev || !r->next) {
        return; /* never made whole: no key was held */
    }
    recency_reset(r);
    for (Py_ssize_t node = 0; node < r->capacity; node++) {
        Py_CLEAR(r->key[node]);
    }
}

/* Linear probing over ``slots`` (``mask + 1`` of them, each an index into ``keys`` and
 * ``hashes``, or NONE): the slot holding ``key`` (*found 1), or the empty slot where it
 * would go (*found 0); -1 with an exception set if a comparison failed. Both the
 * recency table and the scratch key set probe this way. */
static inline Py_ssize_t
probe_slot(const Py_ssize_t *slots, size_t mask, PyObject *const *keys, const Py_hash_t *hashes,
           PyObject *key, Py_hash_t hash, int *found)
{
    size_t slot = recency_spread(hash) & mask;
    for (;;) {
        Py_ssize_t index = slots[slot];
        if (index == NONE) {
            *found = 0;
            return (Py_ssize_t)slot;
        }
        if (hashes[index] == hash) {
            int eq = recency_keys_equal(keys[index], key);
            if (eq < 0) {
                return -1;
            }
            if (eq) {
                *found = 1;
                return (Py_ssize_t)slot;
            }
        }
        slot = (slot + 1) & mask;
    }
}

/* The slot holding ``key``'s node, or the empty slot where it would go (*found 0). */
static inline Py_ssize_t
recency_slot(Recency *r, PyObject *key, Py_hash_t hash, int *found)
{
    return probe_slot(r->table, r->mask, r->key, r->hash, key, hash, found);
}

/* ``key``'s node, NONE if not held, or LOOKUP_FAILED with an exception set; its hash
 * goes to ``*hash_out`` where given. */
static inline Py_ssize_t
recency_find(Recency *r, PyObject *key, Py_hash_t *hash_out)
{
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) {
        return LOOKUP_FAILED;
    }
    if (hash_out != NULL) {
        *hash_out = hash;
    }
    int found;
    Py_ssize_t slot = recency_slot(r, key, hash, &found);
    if (slot < 0) {
        return LOOKUP_FAILED;
    }
    return found ? r->table[slot] : NONE;
}

/* A list of nodes over the table's ``prev``/``next`` links: the table's own recency list,
 * or another one a caller keeps (S3-FIFO's main queue), each node on one list at a time. */
static inline void
list_unlink(Recency *r, Py_ssize_t *oldest, Py_ssize_t *newest, Py_ssize_t node)
{
    Py_ssize_t before = r->prev[node], after = r->next[node];
    if (before == NONE) {
        *oldest = after;
    } else {
        r->next[before] = after;
    }
    if (after == NONE) {
        *newest = before;
    } else {
        r->prev[after] = before;
    }
}

static inline void
list_append(Recency *r, Py_ssize_t *oldest, Py_ssize_t *newest, Py_ssize_t node)
{
    r->prev[node] = *newest;
    r->next[node] = NONE;
    if (*newest == NONE) {
        *oldest = node;
    } else {
        r->next[*newest] = node;
    }
    *newest = node;
}

static inline void
recency_unlink(Recency *r, Py_ssize_t node)
{
    list_unlink(r, &r->oldest, &r->newest, node);
}

static inline void
recency_append(Recency *r, Py_ssize_t node)
{
    list_append(r, &r->oldest, &r->newest, node);
}

static inline void
recency_make_newest(Recency *r, Py_ssize_t node)
{
    if (node != r->newest) {
        recency_unlink(r, node);
        recency_append(r, node);
    }
}

/* Drop ``node``, already off its list, from the table (backward-shift deletion) and
 * return it to the pool. Its slot is found by the node's index, not by comparing keys: no
 * Python code runs and nothing fails, so an eviction never stops half done (a key's
 * ``__eq__`` raising there left a node in the table but on no list). */
static inline void
recency_forget(Recency *r, Py_ssize_t node)
{
    size_t hole = recency_spread(r->hash[node]) & r->mask;
    while (r->table[hole] != node) {
        hole = (hole + 1) & r->mask;
    }
    size_t probe = hole;
    for (;;) {
        probe = (probe + 1) & r->mask;
        Py_ssize_t moved = r->table[probe];
        if (moved == NONE) {
            break;
        }
        size_t home = recency_spread(r->hash[moved]) & r->mask;
        /* ``moved`` may fill the hole unless its home lies cyclically in (hole, probe]. */
        int stays = hole <= probe ? (hole < home && home <= probe) : (hole < home || home <= probe);
        if (!stays) {
            r->table[hole] = moved;
            hole = probe;
        }
    }
    r->table[hole] = NONE;
    /* The key is released last: its ``__del__`` may run, and finds the table whole. */
    PyObject *key = r->key[node];
    r->key[node] = NULL;
    r->next[node] = r->free_list;
    r->free_list = node;
    r->size--;
    Py_DECREF(key);
}

/* Drop ``node`` from the table, the recency list and the pool. */
static inline void
recency_remove(Recency *r, Py_ssize_t node)
{
    recency_unlink(r, node);
    recency_forget(r, node);
}

/* Add ``key`` (not held; a free node exists) as the newest; its node, or -1. */
static inline Py_ssize_t
recency_add(Recency *r, PyObject *key, Py_hash_t hash)
{
    int found;
    Py_ssize_t slot = recency_slot(r, key, hash, &found);
    if (slot < 0) {
        return -1;
    }
    Py_ssize_t node = r->free_list;
    r->free_list = r->next[node];
    Py_INCREF(key);
    r->key[node] = key;
    r->hash[node] = hash;
    r->table[slot] = node;
    recency_append(r, node);
    r->size++;
    return node;
}

/* Bytes of the table's own arrays (the keys are the caller's objects, held by reference). */
static inline Py_ssize_t
recency_bytes(const Recency *r)
{
    size_t per_node = sizeof(PyObject *) + sizeof(Py_hash_t) + 2 * sizeof(Py_ssize_t);
    return (Py_ssize_t)((r->mask + 1) * sizeof(Py_ssize_t) + (size_t)r->capacity * per_node);
}

/* The held keys, oldest first, as a new list. */
static inline PyObject *
recency_keys(Recency *r)
{
    PyObject *result = PyList_New(r->size);
    if (result == NULL) {
        return NULL;
    }
    Py_ssize_t i = 0;
    for (Py_ssize_t node = r->oldest; node != NONE; node = r->next[node]) {
        Py_INCREF(r->key[node]);
        PyList_SET_ITEM(result, i++, r->key[node]);
    }
    return result;
}

/* A sequence argument's items, held by the call. Python code the call runs (a key's
 * ``__hash__``, ``__eq__`` or ``__del__``, a gap flag's ``__bool__``, ``keep``'s
 * ``__contains__``) may change a list argument: the list's own item array, which
 * PySequence_Fast hands out, was freed under the loop reading it, and keys kept borrowed
 * were freed before the table took them. The call holds a reference to each item, in place
 * (4 KiB of stack: a request of up to 512 blocks, nearly every one) or in an array of its
 * own: no object is made per call (a tuple copy would be one, and count towards the next
 * collection). At 64 in place, the longer requests' arrays took 2% more instructions on the
 * Mooncake replay; at 512, 0.3%. */
#define HELD_IN_PLACE 512

typedef struct {
    PyObject **item;
    Py_ssize_t len;
    PyObject *in_place[HELD_IN_PLACE];
} HeldItems;

/* Nothing held yet (``held_release`` does nothing). */
static inline void
held_none(HeldItems *held)
{
    held->item = held->in_place;
    held->len = 0;
}

/* Hold ``arg``'s items (none where ``arg`` is NULL, an argument not given); 0, or -1 with
 * TypeError (``message``) or MemoryError; ``held_release`` is safe either way. */
static inline int
held_take(HeldItems *held, PyObject *arg, const char *message)
{
    held_none(held);
    if (arg == NULL) {
        return 0;
    }
    PyObject *fast = PySequence_Fast(arg, message);
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > HELD_IN_PLACE && (held->item = PyMem_New(PyObject *, (size_t)n)) == NULL) {
        held->item = held->in_place;
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(items[i]);
        held->item[i] = items[i];
    }
    held->len = n;
    Py_DECREF(fast);
    return 0;
}

/* Drop the call's references (the last one to an item may run its ``__del__``). */
static inline void
held_release(HeldItems *held)
{
    PyObject **item = held->item;
    Py_ssize_t n = held->len;
    held_none(held);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(item[i]);
    }
    if (item != held->in_place) {
        PyMem_Free(item);
    }
}

/* Raise kvoffload's InvalidArgumentError (a ValueError) with ``message``. */
static inline void
recency_invalid(const char *message)
{
    PyObject *errors = PyImport_ImportModule("kvoffload.core.errors");
    PyObject *invalid = errors ? PyObject_GetAttrString(errors, "InvalidArgumentError") : NULL;
    Py_XDECREF(errors);
    if (invalid != NULL) {
        PyErr_SetString(invalid, message);
        Py_DECREF(invalid);
    }
}

/* Grow ``*buffer`` to ``count`` items of ``item`` bytes; 0, or -1 with MemoryError. */
static inline int
recency_grow(void **buffer, Py_ssize_t count, size_t item)
{
    void *bigger = PyMem_Realloc(*buffer, (size_t)count * item);
    if (bigger == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *buffer = bigger;
    return 0;
}

/* A scratch set of borrowed keys for one call (new keys of a store, an admitted list):
 * insertion order kept in ``key``/``hash``, an open-addressing index over them. */
typedef struct {
    PyObject **key;
    Py_hash_t *hash;
    Py_ssize_t len, cap;
    Py_ssize_t *slots;
    size_t mask;
} KeySet;

/* The index slots for ``n`` keys: at most half full, 16 at least. */
static inline size_t
keyset_slots(Py_ssize_t n)
{
    size_t slots = 16;
    while (slots < (size_t)n * 2) {
        slots <<= 1;
    }
    return slots;
}

/* Empty ``s``, with room for ``n`` keys; 0 or -1. The arrays keep the size of the largest
 * call, but the index in use (``mask``) is sized for this one: clearing the index grown
 * for the longest request at every call cost more than most calls' own work. */
static inline int
keyset_reset(KeySet *s, Py_ssize_t n)
{
    if (n > s->cap || s->slots == NULL) {
        Py_ssize_t cap = n < 64 ? 64 : n;
        if (recency_grow((void **)&s->key, cap, sizeof(PyObject *)) < 0 ||
            recency_grow((void **)&s->hash, cap, sizeof(Py_hash_t)) < 0 ||
            recency_grow((void **)&s->slots, (Py_ssize_t)keyset_slots(cap), sizeof(Py_ssize_t)) < 0) {
            return -1;
        }
        s->cap = cap;
    }
    size_t slots = keyset_slots(n);
    s->mask = slots - 1;
    memset(s->slots, 0xff, slots * sizeof(Py_ssize_t));
    s->len = 0;
    return 0;
}

/* The slot of ``key`` in ``s`` (*found 1) or where it would go (*found 0); -1 on error. */
static inline Py_ssize_t
keyset_slot(const KeySet *s, PyObject *key, Py_hash_t hash, int *found)
{
    return probe_slot(s->slots, s->mask, s->key, s->hash, key, hash, found);
}

/* Add ``key`` (room was made by keyset_reset): 1 if added (at index len - 1), 0 if it
 * was there, -1 on error. */
static inline int
keyset_add(KeySet *s, PyObject *key, Py_hash_t hash)
{
    int found;
    Py_ssize_t slot = keyset_slot(s, key, hash, &found);
    if (slot < 0) {
        return -1;
    }
    if (found) {
        return 0;
    }
    s->slots[slot] = s->len;
    s->key[s->len] = key;
    s->hash[s->len] = hash;
    s->len++;
    return 1;
}

/* 1 if ``key`` is in ``s``, 0 if not, -1 on error. */
static inline int
keyset_has(const KeySet *s, PyObject *key, Py_hash_t hash)
{
    int found;
    return keyset_slot(s, key, hash, &found) < 0 ? -1 : found;
}

static inline void
keyset_free(KeySet *s)
{
    PyMem_Free(s->key);
    PyMem_Free(s->hash);
    PyMem_Free(s->slots);
    memset(s, 0, sizeof(*s));
}

/* Nodes given a flag for the call in progress (a store's protected keys, a batch's
 * shielded ones), remembered so that the flag is cleared on every node at its end. */
typedef struct {
    Py_ssize_t *node;
    Py_ssize_t len, cap;
} MarkedNodes;

/* Give ``node`` ``flag`` in ``flags`` unless it has it; 1 if it was marked now, 0 if it
 * had it, -1 with MemoryError. */
static inline int
marked_add(MarkedNodes *marked, unsigned char *flags, Py_ssize_t node, unsigned char flag)
{
    if (flags[node] & flag) {
        return 0;
    }
    if (marked->len == marked->cap) {
        Py_ssize_t cap = marked->cap ? 2 * marked->cap : 64;
        if (recency_grow((void **)&marked->node, cap, sizeof(Py_ssize_t)) < 0) {
            return -1;
        }
        marked->cap = cap;
    }
    marked->node[marked->len++] = node;
    flags[node] |= flag;
    return 1;
}

/* Take ``flag`` off every node marked since the last clear. */
static inline void
marked_clear(MarkedNodes *marked, unsigned char *flags, unsigned char flag)
{
    for (Py_ssize_t i = 0; i < marked->len; i++) {
        flags[marked->node[i]] &= (unsigned char)~flag;
    }
    marked->len = 0;
}

/* Whether ``capacity`` (of a table of ``what``) is usable; if not, InvalidArgumentError. */
static inline int
recency_capacity_ok(Py_ssize_t capacity, const char *what)
{
    if (capacity >= 1 && capacity <= PY_SSIZE_T_MAX / 16) {
        return 1;
    }
    char message[96];
    snprintf(message, sizeof(message), "%s capacity must be >= 1, got %zd", what, capacity);
    recency_invalid(message);
    return 0;
}

/* What every table type starts with, so that its length, membership and capacity are
 * served by one set of slots, and its calls are guarded by one flag. */
#define RECENCY_OBJECT_FIELDS \
    PyObject_HEAD             \
    Recency r;                \
    int in_call;              /* a call on the table is running */

typedef struct {
    RECENCY_OBJECT_FIELDS
} RecencyObject;

/* Start a call on table ``self``: 1, or 0 with RuntimeError where one is running. Keys'
 * ``__hash__`` and ``__eq__``, a store's gap flags and ``keep``'s ``__contains__`` are
 * Python code run mid-call; a second call from there changed the table under the first
 * one (a node added with none free, scratch arrays reallocated under their readers). */
static inline int
recency_enter(PyObject *self)
{
    RecencyObject *table = (RecencyObject *)self;
    if (table->in_call) {
        PyErr_Format(PyExc_RuntimeError, "%.100s was called again from inside one of its calls",
                     Py_TYPE(self)->tp_name);
        return 0;
    }
    table->in_call = 1;
    return 1;
}

static inline void
recency_leave(PyObject *self)
{
    ((RecencyObject *)self)->in_call = 0;
}

/* ``method``_guarded: ``method`` (METH_O, METH_NOARGS or METH_VARARGS) as the table's only
 * call in progress. */
#define RECENCY_GUARDED(method)                                      \
    static PyObject *method##_guarded(PyObject *self, PyObject *arg) \
    {                                                                \
        if (!recency_enter(self)) {                                  \
            return NULL;                                             \
        }                                                            \
        PyObject *result = method((void *)self, arg);                \
        recency_leave(self);                                         \
        return result;                                               \
    }

/* The same for a METH_VARARGS | METH_KEYWORDS ``method``. */
#define RECENCY_GUARDED_KW(method)                                                    \
    static PyObject *method##_guarded(PyObject *self, PyObject *args, PyObject *kwargs) \
    {                                                                                 \
        if (!recency_enter(self)) {                                                   \
            return NULL;                                                              \
        }                                                                             \
        PyObject *result = method((void *)self, args, kwargs);                        \
        recency_leave(self);                                                          \
        return result;                                                                \
    }

/* The collector's tp_clear of a table type: ``empty`` resets what the type keeps about its
 * nodes and empties its tables, as the only call in progress, so that a released key's
 * ``__del__`` finds the table refusing calls rather than half emptied. */
static inline int
recency_object_clear(PyObject *self, void (*empty)(PyObject *))
{
    RecencyObject *table = (RecencyObject *)self;
    int in_call = table->in_call;
    table->in_call = 1;
    empty(self);
    table->in_call = in_call;
    return 0;
}

static inline Py_ssize_t
recency_object_len(PyObject *self)
{
    return ((RecencyObject *)self)->r.size;
}

static inline int
recency_object_contains(PyObject *self, PyObject *key)
{
    if (!recency_enter(self)) {
        return -1;
    }
    Py_ssize_t node = recency_find(&((RecencyObject *)self)->r, key, NULL);
    recency_leave(self);
    return node == LOOKUP_FAILED ? -1 : node != NONE;
}

static inline PyObject *
recency_object_capacity(PyObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(((RecencyObject *)self)->r.capacity);
}

static PySequenceMethods recency_as_sequence = {
    .sq_length = recency_object_len,
    .sq_contains = recency_object_contains,
};

/* The module of ``definition`` with ``type`` readied and added under ``name``, or NULL. */
static inline PyObject *
recency_module(PyModuleDef *definition, PyTypeObject *type, const char *name)
{
    if (PyType_Ready(type) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(definition);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(type);
    if (PyModule_AddObject(module, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

#endif
