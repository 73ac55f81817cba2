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

/* ``index`` into a list of ``size`` items as Python indexes one (negative: from the end),
 * or -1 with IndexError. */
static Py_ssize_t
list_position(Py_ssize_t index, Py_ssize_t size)
{
    Py_ssize_t position = index < 0 ? index + size : index;
    if (position < 0 || position >= size) {
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        return -1;
    }
    return position;
}

/* ``list[position] += 1.0`` as Python computes it (a new float object), or -1. */
static int
add_one(PyObject *list, Py_ssize_t position, PyObject *one)
{
    PyObject *sum = PyNumber_Add(PyList_GET_ITEM(list, position), one);
    if (sum == NULL) {
        return -1;
    }
    return PyList_SetItem(list, position, sum);
}

/* The controller's outcomes (``ReuseController.record_all``, its Python loop the reference):
 * for each tag in turn its class's admitting count is set to ``uncounted``, its class's and
 * group's outcome counts (and, ``returned``, return counts) gain 1.0, and ``since`` gains 1;
 * it stops after the tag that brings ``since`` to ``window``, where the caller halves the
 * counts. Every tag is checked before any count changes. Returns (tags counted, since). */
static PyObject *
record_outcomes(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "record_outcomes expected 6 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *counts = args[5];
    Py_ssize_t groups = PyLong_AsSsize_t(args[2]);
    Py_ssize_t window = PyLong_AsSsize_t(args[3]);
    Py_ssize_t since = PyLong_AsSsize_t(args[4]);
    int returned = PyObject_IsTrue(args[1]);
    if (PyErr_Occurred() || returned < 0) {
        return NULL;
    }
    if (groups < 1) {
        PyErr_SetString(PyExc_ValueError, "record_outcomes: groups must be >= 1");
        return NULL;
    }
    PyObject *admitting, *outcomes, *group_outcomes, *returns, *group_returns, *uncounted;
    if (!PyArg_ParseTuple(counts, "O!O!O!O!O!O:record_outcomes", &PyList_Type, &admitting,
                          &PyList_Type, &outcomes, &PyList_Type, &group_outcomes, &PyList_Type,
                          &returns, &PyList_Type, &group_returns, &uncounted)) {
        return NULL;
    }
    PyObject *tags = PySequence_Fast(args[0], "record_outcomes: tags must be a sequence");
    if (tags == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tags);
    Py_ssize_t classes = PyList_GET_SIZE(outcomes);
    Py_ssize_t tagged = PyList_GET_SIZE(group_outcomes);
    if (PyList_GET_SIZE(admitting) != classes || PyList_GET_SIZE(returns) != classes
        || PyList_GET_SIZE(group_returns) != tagged) {
        Py_DECREF(tags);
        PyErr_SetString(PyExc_ValueError, "record_outcomes: count lists of unequal lengths");
        return NULL;
    }
    PyObject *one = PyFloat_FromDouble(1.0);
    if (one == NULL) {
        Py_DECREF(tags);
        return NULL;
    }
    Py_ssize_t stop = n < window - since ? n : window - since;
    if (stop < 1) {
        stop = n < 1 ? n : 1; /* already at the window: one tag, then the caller halves */
    }
    PyObject **items = PySequence_Fast_ITEMS(tags);
    Py_ssize_t done = 0;
    for (Py_ssize_t i = 0; i < stop; i++) { /* checked first: a bad tag changes nothing */
        Py_ssize_t tag = PyLong_AsSsize_t(items[i]);
        if ((tag == -1 && PyErr_Occurred()) || list_position(tag, tagged) < 0) {
            goto failed;
        }
        Py_ssize_t cls = tag / groups - (tag % groups != 0 && tag < 0); /* Python's // */
        if (list_position(cls, classes) < 0) {
            goto failed;
        }
    }
    for (; done < stop; done++) {
        Py_ssize_t tag = PyLong_AsSsize_t(items[done]);
        Py_ssize_t cls = tag / groups - (tag % groups != 0 && tag < 0);
        Py_ssize_t at_class = cls < 0 ? cls + classes : cls;
        Py_ssize_t at_tag = tag < 0 ? tag + tagged : tag;
        Py_INCREF(uncounted);
        if (PyList_SetItem(admitting, at_class, uncounted) < 0
            || add_one(outcomes, at_class, one) < 0 || add_one(group_outcomes, at_tag, one) < 0
            || (returned
                && (add_one(returns, at_class, one) < 0
                    || add_one(group_returns, at_tag, one) < 0))) {
            goto failed;
        }
        since++;
    }
    Py_DECREF(one);
    Py_DECREF(tags);
    return Py_BuildValue("nn", done, since);
failed:
    Py_DECREF(one);
    Py_DECREF(tags);
    return NULL;
}

static PyMethodDef ghost_module_methods[] = {
    {"record_outcomes", (PyCFunction)(void (*)(void))record_outcomes, METH_FASTCALL,
     "record_outcomes(tags, returned, groups, window, since, counts, /)\n--\n\n"
     "The controller's outcomes of ``tags`` up to a halving: (tags counted, since)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ghost_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload.admission._ghost",
    .m_doc = "Ghost records in C (ghost.GhostRecords is the reference), and the feedback "
             "controller's outcome counts (controller.ReuseController.record_all).",
    .m_size = -1,
    .m_methods = ghost_module_methods,
};

PyMODINIT_FUNC
PyInit__ghost(void)
{
    return recency_module(&ghost_module, &GhostTableType, "GhostTable");
}
