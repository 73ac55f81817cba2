/* The frequency sketch's per-request work in C: key hashes, and the sketch's increment
 * and estimate over a batch of hashes.
 *
 * ``sketch.py`` does the same with a dozen numpy calls per request, each costing about a
 * microsecond whatever its size; a request has tens of keys, so the call overhead was
 * most of the work. The arithmetic is that of the numpy path, step for step (the same
 * fold, mix, multipliers and shifts, and numpy's order of reads and writes where one
 * batch touches a cell twice); ``tests/admission/test_sketch.py`` holds the two equal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROWS 4
#define DOOR_BITS 4
#define MAX_COUNT 15
#define TAIL_BYTES 12
#define LANES (2 + ROWS) /* two doorkeeper cells, then one counter per row */

static const uint64_t MULTIPLIERS[LANES] = {
    1ULL, 0x2545F4914F6CDD1DULL, 0x9E3779B97F4A7C15ULL,
    0xD6E8FEB86659FD93ULL, 0xC2B2AE3D27D4EB4FULL, 0xFF51AFD7ED558CCDULL,
};

/* The key's last 12 bytes as a 96-bit big-endian number, folded to 64 bits, mixed. */
static uint64_t
key_hash(const unsigned char *key, Py_ssize_t length)
{
    Py_ssize_t start = length > TAIL_BYTES ? length - TAIL_BYTES : 0;
    uint64_t low = 0, high = 0;
    for (Py_ssize_t i = start; i < length; i++) {
        high = (high << 8) | (low >> 56);
        low = (low << 8) | key[i];
    }
    uint64_t h = low ^ high;
    h ^= h >> 30;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 27;
    h *= 0x94D049BB133111EBULL;
    h ^= h >> 31;
    return h;
}

static PyObject *
hash_keys(PyObject *Py_UNUSED(module), PyObject *keys)
{
    PyObject *fast = PySequence_Fast(keys, "keys must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *result = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (result == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    uint64_t *out = (uint64_t *)PyBytes_AS_STRING(result);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "keys must be bytes, got %.100s", Py_TYPE(items[i])->tp_name);
            Py_DECREF(result);
            Py_DECREF(fast);
            return NULL;
        }
        out[i] = key_hash((const unsigned char *)PyBytes_AS_STRING(items[i]), PyBytes_GET_SIZE(items[i]));
    }
    Py_DECREF(fast);
    return result;
}

/* The ``i``-th hash of a buffer of hashes. A buffer need not be 8-byte aligned (a slice of
 * bytes, a memoryview at an odd offset), and reading it as ``uint64_t`` there is undefined
 * behaviour; memcpy is not, and compilers make it the same single load. */
static inline uint64_t
hash_at(const unsigned char *hashes, Py_ssize_t i)
{
    uint64_t hash;
    memcpy(&hash, hashes + i * (Py_ssize_t)sizeof(hash), sizeof(hash));
    return hash;
}

/* The table and the hashes as buffers, checked against the sketch's width. */
typedef struct {
    Py_buffer table, hashes;
    Py_ssize_t n, width, counters;
    int shift, door_shift;
} Batch;

static int
batch_open(Batch *batch, PyObject *table, PyObject *hashes, int bits, const char *name, int writable)
{
    if (bits < 1 || bits > 40) {
        PyErr_Format(PyExc_ValueError, "%s: width bits must be in 1..40, got %d", name, bits);
        return -1;
    }
    if (PyObject_GetBuffer(table, &batch->table, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (PyObject_GetBuffer(hashes, &batch->hashes, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&batch->table);
        return -1;
    }
    batch->width = (Py_ssize_t)1 << bits;
    batch->counters = ROWS * batch->width;
    batch->shift = 64 - bits;
    batch->door_shift = 64 - bits - DOOR_BITS;
    batch->n = batch->hashes.len / (Py_ssize_t)sizeof(uint64_t);
    if (batch->table.len != batch->counters + (batch->width << DOOR_BITS) ||
        batch->hashes.len % (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_Format(PyExc_ValueError, "%s: table or hashes do not fit a sketch of that width", name);
        PyBuffer_Release(&batch->table);
        PyBuffer_Release(&batch->hashes);
        return -1;
    }
    return 0;
}

static void
batch_close(Batch *batch)
{
    PyBuffer_Release(&batch->table);
    PyBuffer_Release(&batch->hashes);
}

static Py_ssize_t
cell(const Batch *batch, uint64_t hash, int lane)
{
    uint64_t product = hash * MULTIPLIERS[lane];
    if (lane < 2) {
        return batch->counters + (Py_ssize_t)(product >> batch->door_shift);
    }
    return (lane - 2) * batch->width + (Py_ssize_t)(product >> batch->shift);
}

/* One sighting of each hash: every read before any write, then the counter writes in
 * numpy's order (row by row), an unseen hash's redirected to its first doorkeeper cell,
 * then the doorkeeper cells set; see FrequencySketch.increment. */
static PyObject *
increment(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *table_arg, *hashes_arg;
    int bits;
    Batch batch;
    if (!PyArg_ParseTuple(args, "OOi:increment", &table_arg, &hashes_arg, &bits) ||
        batch_open(&batch, table_arg, hashes_arg, bits, "increment", 1) < 0) {
        return NULL;
    }
    Py_ssize_t n = batch.n;
    unsigned char *table = batch.table.buf;
    const unsigned char *hashes = batch.hashes.buf;
    Py_ssize_t *cells = PyMem_Malloc((size_t)(n ? n : 1) * LANES * sizeof(Py_ssize_t));
    unsigned char *values = PyMem_Malloc((size_t)(n ? n : 1) * LANES);
    if (cells == NULL || values == NULL) {
        PyMem_Free(cells);
        PyMem_Free(values);
        batch_close(&batch);
        return PyErr_NoMemory();
    }
    for (int lane = 0; lane < LANES; lane++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t at = cell(&batch, hash_at(hashes, i), lane);
            cells[lane * n + i] = at;
            values[lane * n + i] = table[at];
        }
    }
    for (int lane = 2; lane < LANES; lane++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int seen = values[i] & values[n + i];
            unsigned char count = values[lane * n + i];
            table[seen ? cells[lane * n + i] : cells[i]] = count < MAX_COUNT ? count + 1 : MAX_COUNT;
        }
    }
    for (Py_ssize_t i = 0; i < 2 * n; i++) {
        table[cells[i]] = 1;
    }
    PyMem_Free(cells);
    PyMem_Free(values);
    batch_close(&batch);
    Py_RETURN_NONE;
}

/* The doorkeeper bit plus the smallest counter of one hash. */
static unsigned char
sightings(const Batch *batch, uint64_t hash)
{
    const unsigned char *table = batch->table.buf;
    unsigned char least = table[cell(batch, hash, 2)];
    for (int lane = 3; lane < LANES; lane++) {
        unsigned char count = table[cell(batch, hash, lane)];
        least = count < least ? count : least;
    }
    return (unsigned char)(least + (table[cell(batch, hash, 0)] & table[cell(batch, hash, 1)]));
}

/* Per hash: its estimated sightings, as bytes. */
static PyObject *
estimate(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *table_arg, *hashes_arg;
    int bits;
    Batch batch;
    if (!PyArg_ParseTuple(args, "OOi:estimate", &table_arg, &hashes_arg, &bits) ||
        batch_open(&batch, table_arg, hashes_arg, bits, "estimate", 0) < 0) {
        return NULL;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, batch.n);
    if (result != NULL) {
        unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
        const unsigned char *hashes = batch.hashes.buf;
        for (Py_ssize_t i = 0; i < batch.n; i++) {
            out[i] = sightings(&batch, hash_at(hashes, i));
        }
    }
    batch_close(&batch);
    return result;
}

/* Per hash: whether its estimated sightings reach ``threshold``, as a list of bools. */
static PyObject *
seen_at_least(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *table, *hashes;
    int bits, threshold;
    Batch batch;
    if (!PyArg_ParseTuple(args, "OOii:seen_at_least", &table, &hashes, &bits, &threshold) ||
        batch_open(&batch, table, hashes, bits, "seen_at_least", 0) < 0) {
        return NULL;
    }
    PyObject *result = PyList_New(batch.n);
    if (result != NULL) {
        const unsigned char *hashes = batch.hashes.buf;
        for (Py_ssize_t i = 0; i < batch.n; i++) {
            PyObject *flag = sightings(&batch, hash_at(hashes, i)) >= threshold ? Py_True : Py_False;
            Py_INCREF(flag);
            PyList_SET_ITEM(result, i, flag);
        }
    }
    batch_close(&batch);
    return result;
}

/* ``value`` as a 64-bit mask, or -1 with OverflowError where it is negative or wider: such
 * a mask was wrapped into another one (-1 into every bit), which sampled other keys; the
 * numpy path refuses it too. */
static int
as_mask(PyObject *value, uint64_t *mask)
{
    PyObject *index = PyNumber_Index(value);
    if (index == NULL) {
        return -1;
    }
    unsigned long long bits = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (bits == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *mask = bits;
    return 0;
}

/* Per mask (each a superset of the bits of the one before), the positions of the hashes
 * whose masked bits are all zero: the mini-simulations' sampled keys at each rate. */
static PyObject *
sampled_positions(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *hashes_arg, *masks;
    if (!PyArg_ParseTuple(args, "OO!:sampled_positions", &hashes_arg, &PyTuple_Type, &masks)) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(hashes_arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (view.len % (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "sampled_positions: hashes are not 64-bit hashes");
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(uint64_t), levels = PyTuple_GET_SIZE(masks);
    const unsigned char *hashes = view.buf;
    PyObject *result = PyList_New(levels);
    for (Py_ssize_t level = 0; result != NULL && level < levels; level++) {
        uint64_t mask;
        PyObject *picked = as_mask(PyTuple_GET_ITEM(masks, level), &mask) < 0 ? NULL : PyList_New(0);
        for (Py_ssize_t i = 0; picked != NULL && i < n; i++) {
            if (hash_at(hashes, i) & mask) {
                continue;
            }
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(picked, index) < 0) {
                Py_CLEAR(picked);
            }
            Py_XDECREF(index);
        }
        if (picked == NULL) {
            Py_CLEAR(result);
        } else {
            PyList_SET_ITEM(result, level, picked);
        }
    }
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef sketch_methods[] = {
    {"hash_keys", hash_keys, METH_O, "hash_keys($module, keys, /)\n--\n\nEach key's 64-bit hash, native order, as bytes."},
    {"increment", increment, METH_VARARGS, "increment($module, table, hashes, bits, /)\n--\n\nOne sighting of each hash."},
    {"estimate", estimate, METH_VARARGS, "estimate($module, table, hashes, bits, /)\n--\n\nSightings per hash, as bytes."},
    {"seen_at_least", seen_at_least, METH_VARARGS,
     "seen_at_least($module, table, hashes, bits, threshold, /)\n--\n\nPer hash, whether its estimate reaches threshold."},
    {"sampled_positions", sampled_positions, METH_VARARGS,
     "sampled_positions($module, hashes, masks, /)\n--\n\nPer mask, the positions of the hashes with hash & mask == 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sketch_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload.admission._sketch",
    .m_doc = "The frequency sketch's per-request work in C (sketch.py's numpy path is the reference).",
    .m_size = -1,
    .m_methods = sketch_methods,
};

PyMODINIT_FUNC
PyInit__sketch(void)
{
    return PyModule_Create(&sketch_module);
}
