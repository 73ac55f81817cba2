/* Ghost records in C: the same records, order and answers as ``ghost.GhostRecords``.
 *
 * The feedback rule records every first-seen block it offers and looks every
 * request's blocks up, tens of keys a request, in the optimiser's feedback world.
 * The records are a bounded recency table (``_recency.h``) with a tag and a clock per
 * node; ``tests/admission/test_ghost.py`` holds it equal to the Python class.
 */
#include "_recency.h"

typedef struct {
    RECENCY_OBJECT_FIELDS
    long *tag;            /* per node */
    long long *clock;     /* per node */
} GhostTable;

/* Append ``tag`` to ``tags`` (a list), or -1. */
static int
append_tag(PyObject *tags, long tag)
{
    PyObject *value = PyLong_FromLong(tag);
    if (value == NULL) {
        return -1;
    }
    int failed = PyList_Append(tags, value);
    Py_DECREF(value);
    return failed;
}

/* Record each key in turn (a recorded one becomes the newest with the new tag and
 * clock); the tags of the records pushed out. */
static PyObject *
ghost_add_all(GhostTable *self, PyObject *args)
{
    PyObject *keys;
    long tag;
    long long clock = 0;
    if (!PyArg_ParseTuple(args, "Ol|L:add_all", &keys, &tag, &clock)) {
        return NULL;
    }
    HeldItems held;
    if (held_take(&held, keys, "keys must be a sequence") < 0) {
        return NULL;
    }
    PyObject **items = held.item;
    Py_ssize_t n = held.len;
    PyObject *pushed = PyList_New(0);
    for (Py_ssize_t i = 0; pushed != NULL && i < n; i++) {
        Py_hash_t hash;
        Py_ssize_t node = recency_find(&self->r, items[i], &hash);
        if (node == LOOKUP_FAILED) {
            Py_CLEAR(pushed);
            break;
        }
        if (node == NONE) {
            if (self->r.size == self->r.capacity) {
                Py_ssize_t oldest = self->r.oldest;
                if (append_tag(pushed, self->tag[oldest]) < 0) {
                    Py_CLEAR(pushed);
                    break;
                }
                recency_remove(&self->r, oldest);
            }
            node = recency_add(&self->r, items[i], hash);
            if (node < 0) {
                Py_CLEAR(pushed);
                break;
            }
        } else {
            recency_make_newest(&self->r, node);
        }
        self->tag[node] = tag;
        self->clock[node] = clock;
    }
    held_release(&held);
    return pushed;
}

/* Forget the recorded keys among ``keys``; their tags, in ``keys`` order. */
static PyObject *
ghost_take_all(GhostTable *self, PyObject *keys)
{
    HeldItems held;
    if (held_take(&held, keys, "keys must be a sequence") < 0) {
        return NULL;
    }
    PyObject **items = held.item;
    Py_ssize_t n = held.len;
    PyObject *taken = PyList_New(0);
    for (Py_ssize_t i = 0; taken != NULL && self->r.size && i < n; i++) {
        Py_ssize_t node = recency_find(&self->r, items[i], NULL);
        if (node == LOOKUP_FAILED) {
            Py_CLEAR(taken);
        } else if (node != NONE) {
            long tag = self->tag[node];
            recency_remove(&self->r, node);
            if (append_tag(taken, tag) < 0) {
                Py_CLEAR(taken);
            }
        }
    }
    held_release(&held);
    return taken;
}

/* Drop the oldest records made at a clock below ``before``; their tags. */
static PyObject *
ghost_expire(GhostTable *self, PyObject *arg)
{
    long long before = PyLong_AsLongLong(arg);
    if (before == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *expired = PyList_New(0);
    while (expired != NULL && self->r.oldest != NONE && self->clock[self->r.oldest] < before) {
        Py_ssize_t oldest = self->r.oldest;
        if (append_tag(expired, self->tag[oldest]) < 0) {
            Py_CLEAR(expired);
        } else {
            recency_remove(&self->r, oldest);
        }
    }
    return expired;
}

static PyObject *
ghost_records(GhostTable *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *result = PyList_New(self->r.size);
    if (result == NULL) {
        return NULL;
    }
    Py_ssize_t i = 0;
    for (Py_ssize_t node = self->r.oldest; node != NONE; node = self->r.next[node]) {
        PyObject *record = Py_BuildValue("(OlL)", self->r.key[node], self->tag[node], self->clock[node]);
        if (record == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyList_SET_ITEM(result, i++, record);
    }
    return result;
}

static PyObject *
ghost_memory_bytes(GhostTable *self, void *Py_UNUSED(closure))
{
    Py_ssize_t per_node = (Py_ssize_t)(sizeof(long) + sizeof(long long));
    return PyLong_FromSsize_t(recency_bytes(&self->r) + self->r.capacity * per_node);
}

static int
ghost_traverse(GhostTable *self, visitproc visit, void *arg)
{
    return recency_traverse(&self->r, visit, arg);
}

static void
ghost_empty(PyObject *op)
{
    recency_clear(&((GhostTable *)op)->r);
}

static int
ghost_clear(GhostTable *self)
{
    return recency_object_clear((PyObject *)self, ghost_empty);
}

static void
ghost_dealloc(GhostTable *self)
{
    PyObject_GC_UnTrack(self);
    recency_free(&self->r);
    PyMem_Free(self->tag);
    PyMem_Free(self->clock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
ghost_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"capacity", NULL};
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:GhostTable", names, &capacity)) {
        return NULL;
    }
    if (!recency_capacity_ok(capacity, "ghost")) {
        return NULL;
    }
    GhostTable *self = (GhostTable *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->tag = PyMem_Malloc((size_t)capacity * sizeof(long));
    self->clock = PyMem_Malloc((size_t)capacity * sizeof(long long));
    if (recency_init(&self->r, capacity) < 0 || self->tag == NULL || self->clock == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

RECENCY_GUARDED(ghost_add_all)
RECENCY_GUARDED(ghost_take_all)
RECENCY_GUARDED(ghost_expire)
RECENCY_GUARDED(ghost_records)

static PyMethodDef ghost_methods[] = {
    {"add_all", (PyCFunction)ghost_add_all_guarded, METH_VARARGS,
     "add_all($self, keys, tag, clock=0, /)\n--\n\nThe pushed-out tags (see GhostRecords.add_all)."},
    {"take_all", (PyCFunction)ghost_take_all_guarded, METH_O, "take_all($self, keys, /)\n--\n\nForget the recorded keys; their tags."},
    {"expire", (PyCFunction)ghost_expire_guarded, METH_O, "expire($self, before, /)\n--\n\nDrop records made before a clock; their tags."},
    {"records", (PyCFunction)ghost_records_guarded, METH_NOARGS, "records($self, /)\n--\n\n(key, tag, clock) records, oldest first."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ghost_getset[] = {
    {"memory_bytes", (getter)ghost_memory_bytes, NULL, "Bytes of the records' arrays.", NULL},
    {"capacity", recency_object_capacity, NULL, "Records kept at most.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GhostTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvoffload.admission._ghost.GhostTable",
    .tp_basicsize = sizeof(GhostTable),
    .tp_dealloc = (destructor)ghost_dealloc,
    .tp_as_sequence = &recency_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "GhostTable(capacity)\n--\n\nAt most capacity ghost records (key -> tag, clock), oldest first, in C.",
    .tp_traverse = (traverseproc)ghost_traverse,
    .tp_clear = (inquiry)ghost_clear,
    .tp_methods = ghost_methods,
    .tp_getset = ghost_getset,
    .tp_new = ghost_new,
};

static struct PyModuleDef ghost_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload.admission._ghost",
    .m_doc = "Ghost records in C (ghost.GhostRecords is the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__ghost(void)
{
    return recency_module(&ghost_module, &GhostTableType, "GhostTable");
}
