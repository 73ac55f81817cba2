/* The bounded reuse counter in C: the same counts and order as ``reuse_counts.ReuseCounts``.
 *
 * The seed filter counts every key it is shown, and the optimiser runs one in its
 * filter world beside the real tier; a table of tens of thousands of keys is visited
 * at random, so a dict's scattered entries cost cache misses a compact table avoids.
 * The table is a bounded recency table (``_recency.h``) with a count per node, ordered
 * by last count; ``tests/admission/test_reuse_counts.py`` holds it equal to the Python
 * class.
 */
#include "_recency.h"

#define SHIELDED 1u

typedef struct {
    RECENCY_OBJECT_FIELDS
    long long *count;        /* per node */
    unsigned char *flags;    /* per node: shielded by the batch in progress */
    MarkedNodes shielded;
} ReuseCounter;

/* Count ``key`` once more: a held key becomes the newest, a new one pushes out the
 * oldest when the table is full. */
static int
count_one(ReuseCounter *self, PyObject *key)
{
    Py_hash_t hash;
    Py_ssize_t node = recency_find(&self->r, key, &hash);
    if (node == LOOKUP_FAILED) {
        return -1;
    }
    if (node != NONE) {
        self->count[node]++;
        recency_make_newest(&self->r, node);
        return 0;
    }
    if (self->r.size == self->r.capacity) {
        Py_ssize_t oldest = self->r.oldest;
        self->flags[oldest] = 0;
        recency_remove(&self->r, oldest);
    }
    node = recency_add(&self->r, key, hash);
    if (node < 0) {
        return -1;
    }
    self->count[node] = 1;
    return 0;
}

static PyObject *
counter_count(ReuseCounter *self, PyObject *keys)
{
    HeldItems held;
    if (held_take(&held, keys, "keys must be a sequence") < 0) {
        return NULL;
    }
    PyObject **items = held.item;
    Py_ssize_t n = held.len;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (count_one(self, items[i]) < 0) {
            held_release(&held);
            return NULL;
        }
    }
    held_release(&held);
    Py_RETURN_NONE;
}

/* See ReuseCounts.count_shielded: held keys counted (and shielded) first, then the new
 * ones, each pushing out an unshielded key while one is left. */
static PyObject *
counter_count_shielded(ReuseCounter *self, PyObject *keys)
{
    HeldItems held;
    if (held_take(&held, keys, "keys must be a sequence") < 0) {
        return NULL;
    }
    PyObject **items = held.item;
    Py_ssize_t n = held.len;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t node = recency_find(&self->r, items[i], NULL);
        if (node == LOOKUP_FAILED) {
            goto done;
        }
        if (node != NONE) {
            self->count[node]++;
            recency_make_newest(&self->r, node);
            if (marked_add(&self->shielded, self->flags, node, SHIELDED) < 0) {
                goto done;
            }
        }
    }
    Py_ssize_t unshielded = self->r.size - self->shielded.len;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_hash_t hash;
        Py_ssize_t node = recency_find(&self->r, items[i], &hash);
        if (node == LOOKUP_FAILED) {
            goto done;
        }
        if (node != NONE) {
            continue;
        }
        if (self->r.size >= self->r.capacity) {
            if (unshielded == 0) {
                continue;
            }
            Py_ssize_t oldest = self->r.oldest;
            self->flags[oldest] = 0;
            recency_remove(&self->r, oldest);
            unshielded--;
        }
        node = recency_add(&self->r, items[i], hash);
        if (node < 0) {
            goto done;
        }
        self->count[node] = 1;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    marked_clear(&self->shielded, self->flags, SHIELDED);
    held_release(&held);
    return result;
}

static long long
count_of(ReuseCounter *self, Py_ssize_t node)
{
    return node == NONE ? 0 : self->count[node];
}

static PyObject *
counter_at_least(ReuseCounter *self, PyObject *args)
{
    PyObject *keys;
    long long threshold;
    if (!PyArg_ParseTuple(args, "OL:at_least", &keys, &threshold)) {
        return NULL;
    }
    HeldItems held;
    if (held_take(&held, keys, "keys must be a sequence") < 0) {
        return NULL;
    }
    PyObject **items = held.item;
    Py_ssize_t n = held.len;
    PyObject *result = PyList_New(0);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        Py_ssize_t node = recency_find(&self->r, items[i], NULL);
        if (node == LOOKUP_FAILED || (count_of(self, node) >= threshold && PyList_Append(result, items[i]) < 0)) {
            Py_CLEAR(result);
        }
    }
    held_release(&held);
    return result;
}

static PyObject *
counter_get(ReuseCounter *self, PyObject *key)
{
    Py_ssize_t node = recency_find(&self->r, key, NULL);
    return node == LOOKUP_FAILED ? NULL : PyLong_FromLongLong(count_of(self, node));
}

static PyObject *
counter_items(ReuseCounter *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *result = PyList_New(self->r.size);
    if (result == NULL) {
        return NULL;
    }
    Py_ssize_t i = 0;
    for (Py_ssize_t node = self->r.oldest; node != NONE; node = self->r.next[node]) {
        PyObject *pair = Py_BuildValue("(OL)", self->r.key[node], self->count[node]);
        if (pair == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyList_SET_ITEM(result, i++, pair);
    }
    return result;
}

static int
counter_traverse(ReuseCounter *self, visitproc visit, void *arg)
{
    return recency_traverse(&self->r, visit, arg);
}

static void
counter_empty(PyObject *op)
{
    ReuseCounter *self = (ReuseCounter *)op;
    if (self->flags != NULL) {
        memset(self->flags, 0, (size_t)self->r.capacity);
    }
    self->shielded.len = 0;
    recency_clear(&self->r);
}

static int
counter_clear(ReuseCounter *self)
{
    return recency_object_clear((PyObject *)self, counter_empty);
}

static void
counter_dealloc(ReuseCounter *self)
{
    PyObject_GC_UnTrack(self);
    recency_free(&self->r);
    PyMem_Free(self->count);
    PyMem_Free(self->flags);
    PyMem_Free(self->shielded.node);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
counter_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"max_keys", NULL};
    PyObject *max_keys;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:ReuseCounter", names, &max_keys)) {
        return NULL;
    }
    Py_ssize_t capacity = PyLong_Check(max_keys) && !PyBool_Check(max_keys) ? PyLong_AsSsize_t(max_keys) : -1;
    if (capacity == -1 && PyErr_Occurred()) {
        PyErr_Clear();
    }
    /* The bound is reuse_counts.MAX_TRACKED_KEYS; a test holds both tables to it. */
    if (capacity < 1 || capacity > PY_SSIZE_T_MAX / 16) {
        PyObject *shown = PyObject_Repr(max_keys);
        const char *text = shown ? PyUnicode_AsUTF8(shown) : NULL;
        char message[200];
        snprintf(message, sizeof(message), "max tracked keys must be an int from 1 to %zd, got %.100s",
                 PY_SSIZE_T_MAX / 16, text ? text : "?");
        Py_XDECREF(shown);
        PyErr_Clear();
        recency_invalid(message);
        return NULL;
    }
    ReuseCounter *self = (ReuseCounter *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->count = PyMem_Malloc((size_t)capacity * sizeof(long long));
    self->flags = PyMem_Calloc((size_t)capacity, 1);
    if (recency_init(&self->r, capacity) < 0 || self->count == NULL || self->flags == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

RECENCY_GUARDED(counter_count)
RECENCY_GUARDED(counter_count_shielded)
RECENCY_GUARDED(counter_at_least)
RECENCY_GUARDED(counter_get)
RECENCY_GUARDED(counter_items)

static PyMethodDef counter_methods[] = {
    {"count", (PyCFunction)counter_count_guarded, METH_O, "count($self, keys, /)\n--\n\nCount each key once more, in order."},
    {"count_shielded", (PyCFunction)counter_count_shielded_guarded, METH_O,
     "count_shielded($self, keys, /)\n--\n\nCount keys, tracked keys first (see ReuseCounts.count_shielded)."},
    {"at_least", (PyCFunction)counter_at_least_guarded, METH_VARARGS, "at_least($self, keys, threshold, /)\n--\n\nThe keys counted at least threshold times."},
    {"get", (PyCFunction)counter_get_guarded, METH_O, "get($self, key, /)\n--\n\nA key's count (0 if not tracked)."},
    {"items", (PyCFunction)counter_items_guarded, METH_NOARGS, "items($self, /)\n--\n\n(key, count) pairs, least recently counted first."},
    {NULL, NULL, 0, NULL},
};

static PyObject *
counter_memory_bytes(ReuseCounter *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(recency_bytes(&self->r) + self->r.capacity * (Py_ssize_t)(sizeof(long long) + 1));
}

static PyGetSetDef counter_getset[] = {
    {"memory_bytes", (getter)counter_memory_bytes, NULL, "Bytes of the table's arrays.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReuseCounterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.admission._reuse_counts.ReuseCounter",
    .tp_basicsize = sizeof(ReuseCounter),
    .tp_dealloc = (destructor)counter_dealloc,
    .tp_as_sequence = &recency_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "ReuseCounter(max_keys)\n--\n\nCounts of at most max_keys keys, least recently counted leaving first, in C.",
    .tp_traverse = (traverseproc)counter_traverse,
    .tp_clear = (inquiry)counter_clear,
    .tp_methods = counter_methods,
    .tp_getset = counter_getset,
    .tp_new = counter_new,
};

static struct PyModuleDef reuse_counts_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload.admission._reuse_counts",
    .m_doc = "The bounded reuse counter in C (reuse_counts.ReuseCounts is the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__reuse_counts(void)
{
    return recency_module(&reuse_counts_module, &ReuseCounterType, "ReuseCounter");
}
