/* The real tier's per-key loops in C: the same steps as ``block_loops.py``, its reference.
 *
 * The CPU manager and the LRU policy walk a request's keys once per call (look-up, pin,
 * unpin, store completion, touch, eviction), reading and writing each block's
 * ``ref_cnt``: in Python each key costs a score of bytecodes around one or two dict
 * probes. These functions run the same loops over the same Python objects (the
 * manager's dict, the policy's ordered dicts, the ``BlockStatus`` objects), so every
 * result, order and error is the reference's; ``tests/core/test_block_loops.py`` holds
 * the two equal.
 *
 * A block's ``ref_cnt`` and ``block_id`` are ``__slots__``: where the block's type reads
 * them through plain slot descriptors (``BlockStatus``), they are read at the slot's
 * offset, found once per type (and again whenever the type changes: its version tag);
 * any other object goes through ``getattr`` and ``setattr``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#define PENDING_STORE (-1)

static PyObject *name_ref_cnt, *name_block_id, *name_move_to_end, *name_unpark, *name_parked;

/* The one block type whose slots are read directly, with its version tag then. */
static PyTypeObject *slot_type;
static unsigned int slot_tag;
static Py_ssize_t ref_offset, id_offset;

/* The offset of ``name``, a writable object slot of ``type``; 0 where it is something
 * else (a property, a class attribute, an inherited ``__getattr__``...). */
static int
slot_offset(PyTypeObject *type, PyObject *name, Py_ssize_t *offset)
{
    PyObject *descr = _PyType_Lookup(type, name);
    if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type) {
        return 0;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
        return 0;
    }
    *offset = member->offset;
    return 1;
}

/* Whether ``block``'s slots can be read at their offsets (learnt for its type). */
static int
direct(PyObject *block)
{
    PyTypeObject *type = Py_TYPE(block);
    if (type == slot_type && type->tp_version_tag == slot_tag
        && (type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) {
        return 1;
    }
    Py_ssize_t ref, id;
    if (type->tp_getattro != PyObject_GenericGetAttr || type->tp_setattro != PyObject_GenericSetAttr
        || !slot_offset(type, name_ref_cnt, &ref) || !slot_offset(type, name_block_id, &id)
        || !(type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) {
        return 0;
    }
    Py_INCREF(type);
    Py_XSETREF(slot_type, type);
    slot_tag = type->tp_version_tag;
    ref_offset = ref;
    id_offset = id;
    return 1;
}

#define SLOT(block, offset) (*(PyObject **)((char *)(block) + (offset)))

/* ``block.ref_cnt`` as a C long; -1 with an exception set where it cannot be read (a
 * ref_cnt of -1 then has ``PyErr_Occurred``). */
static long
ref_cnt(PyObject *block)
{
    if (direct(block)) {
        PyObject *value = SLOT(block, ref_offset);
        if (value != NULL && PyLong_CheckExact(value)) {
            return PyLong_AsLong(value);
        }
    }
    PyObject *value = PyObject_GetAttr(block, name_ref_cnt);
    if (value == NULL) {
        return -1;
    }
    long result = PyLong_AsLong(value);
    Py_DECREF(value);
    return result;
}

#define REF_FAILED(value) ((value) == -1 && PyErr_Occurred())

static int
set_ref_cnt(PyObject *block, long count)
{
    PyObject *value = PyLong_FromLong(count);
    if (value == NULL) {
        return -1;
    }
    if (direct(block)) {
        Py_XSETREF(SLOT(block, ref_offset), value);
        return 0;
    }
    int result = PyObject_SetAttr(block, name_ref_cnt, value);
    Py_DECREF(value);
    return result;
}

/* ``block.block_id`` (a new reference), or NULL with an exception. */
static PyObject *
block_id(PyObject *block)
{
    if (direct(block)) {
        PyObject *value = SLOT(block, id_offset);
        if (value != NULL) {
            Py_INCREF(value);
            return value;
        }
    }
    return PyObject_GetAttr(block, name_block_id);
}

/* ``blocks[key]`` (a new reference), NULL where absent (no exception) or on error. */
static PyObject *
block_of(PyObject *blocks, PyObject *key)
{
    PyObject *block = PyDict_GetItemWithError(blocks, key);
    Py_XINCREF(block);
    return block;
}

static int
check_dict(PyObject *blocks)
{
    if (!PyDict_Check(blocks)) {
        PyErr_Format(PyExc_TypeError, "blocks must be a dict, got %.100s", Py_TYPE(blocks)->tp_name);
        return -1;
    }
    return 0;
}

/* The i-th key of ``seq`` (a new reference), or NULL once past its end. */
static PyObject *
key_at(PyObject *seq, Py_ssize_t i)
{
    if (i >= PySequence_Fast_GET_SIZE(seq)) {
        return NULL;
    }
    PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
    Py_INCREF(key);
    return key;
}

/* Whether ``nargs`` is ``low .. high``; TypeError naming ``name`` otherwise. */
static int
check_count(const char *name, Py_ssize_t nargs, Py_ssize_t low, Py_ssize_t high)
{
    if (nargs < low || nargs > high) {
        PyErr_Format(PyExc_TypeError, "%s expected %zd arguments, got %zd", name, high, nargs);
        return 0;
    }
    return 1;
}

static PyObject *
leading_ready(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_count("leading_ready", nargs, 2, 2) || check_dict(args[0]) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "keys must be iterable");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t hits = 0;
    PyObject *key;
    while ((key = key_at(seq, hits)) != NULL) {
        PyObject *block = block_of(args[0], key);
        Py_DECREF(key);
        if (block == NULL) {
            break;
        }
        long count = ref_cnt(block);
        Py_DECREF(block);
        if (count < 0) {
            break;
        }
        hits++;
    }
    Py_DECREF(seq);
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(hits);
}

/* Add ``delta`` back to the ``ref_cnt`` of the first ``n`` blocks (a loop undone); keeps
 * an exception set before it. */
static void
undo(PyObject **blocks, Py_ssize_t n, long delta)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    for (Py_ssize_t i = 0; i < n; i++) {
        long count = ref_cnt(blocks[i]);
        if (REF_FAILED(count) || set_ref_cnt(blocks[i], count + delta) < 0) {
            PyErr_Clear();
        }
    }
    PyErr_Restore(type, value, traceback);
}

static void
release_all(PyObject **blocks, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(blocks[i]);
    }
    PyMem_Free(blocks);
}

/* The shared loop of pin_all and unpin_all: ``step`` +1 pins (a key must be held ready),
 * -1 unpins (a key must be held pinned). Returns the refusal's index, or -1 where every
 * key passed, or -2 on error; ``turned`` gets the keys whose count left or reached 0
 * (``listed``: as a list, else only their number in ``*flipped``), ``ids`` (pinning)
 * the blocks' ids. */
static Py_ssize_t
step_all(PyObject *blocks, PyObject *seq, long step, PyObject *ids, PyObject *turned, Py_ssize_t *flipped)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), done = 0, refused = -1;
    PyObject **held = PyMem_New(PyObject *, (size_t)(n ? n : 1));
    if (held == NULL) {
        PyErr_NoMemory();
        return -2;
    }
    *flipped = 0;
    PyObject *key;
    for (Py_ssize_t i = 0; (key = key_at(seq, i)) != NULL; i++) {
        PyObject *block = block_of(blocks, key);
        long count = block == NULL ? 0 : ref_cnt(block);
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            Py_XDECREF(block);
            break;
        }
        if (block == NULL || (step > 0 ? count < 0 : count <= 0)) {
            Py_DECREF(key);
            Py_XDECREF(block);
            refused = i;
            break;
        }
        if (count == (step > 0 ? 0 : 1)) {
            ++*flipped;
            if (turned != NULL && PyList_Append(turned, key) < 0) {
                Py_DECREF(key);
                Py_DECREF(block);
                break;
            }
        }
        Py_DECREF(key);
        if (set_ref_cnt(block, count + step) < 0) {
            Py_DECREF(block);
            break;
        }
        held[done++] = block;
        if (ids != NULL) {
            PyObject *id = block_id(block);
            if (id == NULL || PyList_Append(ids, id) < 0) {
                Py_XDECREF(id);
                break;
            }
            Py_DECREF(id);
        }
    }
    if (PyErr_Occurred() || refused >= 0) {
        undo(held, done, -step);
    }
    release_all(held, done);
    return PyErr_Occurred() ? -2 : refused;
}

static PyObject *
pin_all(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_count("pin_all", nargs, 2, 2) || check_dict(args[0]) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "keys must be iterable");
    PyObject *ids = seq == NULL ? NULL : PyList_New(0);
    if (ids == NULL) {
        Py_XDECREF(seq);
        return NULL;
    }
    Py_ssize_t newly;
    Py_ssize_t refused = step_all(args[0], seq, 1, ids, NULL, &newly);
    Py_DECREF(seq);
    if (refused != -1) {
        Py_DECREF(ids);
        return refused == -2 ? NULL : PyLong_FromSsize_t(refused);
    }
    return Py_BuildValue("(Nn)", ids, newly);
}

static PyObject *
unpin_all(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_count("unpin_all", nargs, 2, 2) || check_dict(args[0]) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "keys must be iterable");
    PyObject *unpinned = seq == NULL ? NULL : PyList_New(0);
    if (unpinned == NULL) {
        Py_XDECREF(seq);
        return NULL;
    }
    Py_ssize_t flipped;
    Py_ssize_t refused = step_all(args[0], seq, -1, NULL, unpinned, &flipped);
    Py_DECREF(seq);
    if (refused != -1) {
        Py_DECREF(unpinned);
        return refused == -2 ? NULL : PyLong_FromSsize_t(refused);
    }
    return unpinned;
}

static PyObject *
mark_ready(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_count("mark_ready", nargs, 2, 2) || check_dict(args[0]) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "keys must be iterable");
    PyObject *changed = seq == NULL ? NULL : PyList_New(0);
    if (changed == NULL) {
        Py_XDECREF(seq);
        return NULL;
    }
    PyObject *key;
    for (Py_ssize_t i = 0; (key = key_at(seq, i)) != NULL; i++) {
        PyObject *block = block_of(args[0], key);
        long count = block == NULL ? 0 : ref_cnt(block);
        int failed = PyErr_Occurred() != NULL;
        if (!failed && block != NULL && count == PENDING_STORE) {
            failed = set_ref_cnt(block, 0) < 0 || PyList_Append(changed, key) < 0;
        }
        Py_DECREF(key);
        Py_XDECREF(block);
        if (failed) {
            Py_CLEAR(changed);
            break;
        }
    }
    Py_DECREF(seq);
    return changed;
}

static PyObject *
drop_victims(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_count("drop_victims", nargs, 3, 3) || check_dict(args[0]) < 0) {
        return NULL;
    }
    if (!PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "free must be a list");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "victims must be iterable");
    PyObject *keys = seq == NULL ? NULL : PyList_New(0);
    if (keys == NULL) {
        Py_XDECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *pair = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, i), "a victim must be a pair");
        int failed = pair == NULL;
        if (!failed && PySequence_Fast_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_ValueError, "a victim must be a (key, block) pair");
            failed = 1;
        }
        if (!failed) {
            PyObject *key = PySequence_Fast_GET_ITEM(pair, 0), *block = PySequence_Fast_GET_ITEM(pair, 1);
            failed = PyDict_DelItem(args[0], key) < 0 || PyList_Append(keys, key) < 0
                || PyList_Append(args[2], block) < 0;
        }
        Py_XDECREF(pair);
        if (failed) {
            Py_CLEAR(keys);
            break;
        }
    }
    Py_DECREF(seq);
    return keys;
}

static PyObject *
claim_pending(PyObject *module, PyObject *blocks)
{
    PyObject *seq = PySequence_Fast(blocks, "blocks must be iterable");
    PyObject *ids = seq == NULL ? NULL : PyList_New(0);
    if (ids == NULL) {
        Py_XDECREF(seq);
        return NULL;
    }
    PyObject *block;
    for (Py_ssize_t i = 0; (block = key_at(seq, i)) != NULL; i++) {
        PyObject *id = set_ref_cnt(block, PENDING_STORE) < 0 ? NULL : block_id(block);
        int failed = id == NULL || PyList_Append(ids, id) < 0;
        Py_XDECREF(id);
        Py_DECREF(block);
        if (failed) {
            Py_CLEAR(ids);
            break;
        }
    }
    Py_DECREF(seq);
    return ids;
}

static PyObject *
move_recent(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_count("move_recent", nargs, 3, 3)) {
        return NULL;
    }
    PyObject *order = args[0], *parking = args[1];
    if (!PyDict_Check(order)) {
        PyErr_SetString(PyExc_TypeError, "order must be an OrderedDict");
        return NULL;
    }
    PyObject *parked = PyObject_GetAttr(parking, name_parked);
    if (parked != NULL && !PyDict_Check(parked)) {
        PyErr_SetString(PyExc_TypeError, "parked must be an OrderedDict");
        Py_CLEAR(parked);
    }
    PyObject *move = parked == NULL ? NULL : PyObject_GetAttr(order, name_move_to_end);
    PyObject *seq = move == NULL ? NULL : PySequence_Fast(args[2], "keys must be iterable");
    if (seq == NULL) {
        Py_XDECREF(parked);
        Py_XDECREF(move);
        return NULL;
    }
    for (Py_ssize_t i = PySequence_Fast_GET_SIZE(seq) - 1; i >= 0; i--) {
        PyObject *key = key_at(seq, i);
        if (key == NULL) {
            break;  /* the list shrank: reversed() stops there too */
        }
        /* move_to_end finds the key itself: a KeyError is the reference's ``key not in
         * order`` (rare: the tier holds what it is told to touch, bar a few) */
        PyObject *done = PyObject_Vectorcall(move, &key, 1, NULL);
        int failed = 0, held = done != NULL;
        Py_XDECREF(done);
        if (!held && PyErr_ExceptionMatches(PyExc_KeyError)) {
            PyErr_Clear();
        } else if (!held) {
            held = -1;
        }
        if (held == 0 && PyDict_GET_SIZE(parked)) {
            held = PyDict_Contains(parked, key);
            if (held > 0) {
                PyObject *block = PyObject_CallMethodOneArg(parking, name_unpark, key);
                failed = block == NULL || PyObject_SetItem(order, key, block) < 0;
                Py_XDECREF(block);
            }
        }
        Py_DECREF(key);
        if (failed || held < 0) {
            Py_DECREF(seq);
            Py_DECREF(parked);
            Py_DECREF(move);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_DECREF(parked);
    Py_DECREF(move);
    Py_RETURN_NONE;
}

static PyObject *
store_pairs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_count("store_pairs", nargs, 3, 3)) {
        return NULL;
    }
    PyObject *mapping = args[0];
    PyObject *keys = PySequence_Fast(args[1], "keys must be iterable");
    PyObject *values = keys == NULL ? NULL : PySequence_Fast(args[2], "values must be iterable");
    if (values == NULL) {
        Py_XDECREF(keys);
        return NULL;
    }
    int exact = PyDict_CheckExact(mapping), failed = 0;
    Py_ssize_t i = 0;
    for (; i < PySequence_Fast_GET_SIZE(keys) && i < PySequence_Fast_GET_SIZE(values); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i), *value = PySequence_Fast_GET_ITEM(values, i);
        Py_INCREF(key);
        Py_INCREF(value);
        failed = (exact ? PyDict_SetItem(mapping, key, value) : PyObject_SetItem(mapping, key, value)) < 0;
        Py_DECREF(key);
        Py_DECREF(value);
        if (failed) {
            break;
        }
    }
    if (!failed && i < PySequence_Fast_GET_SIZE(keys)) {
        PyErr_SetString(PyExc_ValueError, "zip() argument 2 is shorter than argument 1");
    } else if (!failed && i < PySequence_Fast_GET_SIZE(values)) {
        PyErr_SetString(PyExc_ValueError, "zip() argument 2 is longer than argument 1");
    }
    Py_DECREF(keys);
    Py_DECREF(values);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ``list(dict.fromkeys(keys))`` without the dict: an offer's keys, each once, where it
 * first comes (equal by hash and ``==``, the first of equal keys kept), over a probe table
 * of their positions sized for the call. */
static PyObject *
distinct(PyObject *module, PyObject *keys)
{
    enum { IN_PLACE = 128 };
    Py_ssize_t table_in_place[IN_PLACE];
    Py_hash_t hashes_in_place[IN_PLACE / 2];
    PyObject *seq = PySequence_Fast(keys, "keys must be iterable");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    size_t slots = 8;
    while (slots < (size_t)n * 2) {
        slots <<= 1;
    }
    Py_ssize_t *table = slots <= IN_PLACE ? table_in_place : PyMem_New(Py_ssize_t, slots);
    Py_hash_t *hashes = slots <= IN_PLACE ? hashes_in_place : PyMem_New(Py_hash_t, (size_t)n);
    PyObject *result = PyList_New(0);
    if (table == NULL || hashes == NULL || result == NULL) {
        if (result != NULL) {
            PyErr_NoMemory();
        }
        Py_CLEAR(result);
        goto done;
    }
    memset(table, 0xff, slots * sizeof(Py_ssize_t));
    PyObject *key;
    for (Py_ssize_t i = 0; (key = key_at(seq, i)) != NULL; i++) {
        Py_hash_t hash = PyObject_Hash(key);
        int seen = hash == -1 ? -1 : 0;
        size_t slot = (size_t)hash & (slots - 1);
        while (seen == 0 && table[slot] != -1) {
            Py_ssize_t at = table[slot];
            if (hashes[at] == hash) {
                PyObject *kept = PyList_GET_ITEM(result, at);
                Py_INCREF(kept);
                seen = kept == key ? 1 : PyObject_RichCompareBool(kept, key, Py_EQ);
                Py_DECREF(kept);
            }
            slot = (slot + 1) & (slots - 1);
        }
        if (seen == 0) {
            Py_ssize_t at = PyList_GET_SIZE(result);
            if (at >= n) {  /* the keys grew while compared: no room left to index them */
                PyErr_SetString(PyExc_RuntimeError, "keys changed while read");
                seen = -1;
            } else {
                table[slot] = at;
                hashes[at] = hash;
                seen = PyList_Append(result, key) < 0 ? -1 : 0;
            }
        }
        Py_DECREF(key);
        if (seen < 0) {
            Py_CLEAR(result);
            break;
        }
    }
done:
    if (table != table_in_place) {
        PyMem_Free(table);
    }
    if (hashes != hashes_in_place) {
        PyMem_Free(hashes);
    }
    Py_DECREF(seq);
    return result;
}

static PyObject *
front_victims(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    if (!check_count("front_victims", nargs, 3, 3)) {
        return NULL;
    }
    PyObject *order = args[0], *protected = args[2];
    n = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0) {  /* as islice refuses it */
        PyErr_SetString(PyExc_ValueError, "n must be >= 0");
        return NULL;
    }
    if (!PyDict_Check(order)) {
        PyErr_SetString(PyExc_TypeError, "order must be an OrderedDict");
        return NULL;
    }
    PyObject *taken = PyList_New(0);
    PyObject *keys = taken == NULL ? NULL : PyObject_GetIter(order);
    if (keys == NULL) {
        Py_XDECREF(taken);
        return NULL;
    }
    PyObject *key;
    while (PyList_GET_SIZE(taken) < n && (key = PyIter_Next(keys)) != NULL) {
        PyObject *block = PyDict_GetItemWithError(order, key);
        PyObject *pair = block == NULL ? NULL : PyTuple_Pack(2, key, block);
        if (block == NULL && !PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        Py_DECREF(key);
        if (pair == NULL || PyList_Append(taken, pair) < 0) {
            Py_XDECREF(pair);
            break;
        }
        Py_DECREF(pair);
    }
    Py_DECREF(keys);
    if (PyErr_Occurred()) {
        Py_DECREF(taken);
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(taken);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PyList_GET_ITEM(taken, i);
        long ref = ref_cnt(PyTuple_GET_ITEM(pair, 1));
        int shielded = REF_FAILED(ref) ? -1 : ref != 0 ? 1 : PySequence_Contains(protected, PyTuple_GET_ITEM(pair, 0));
        if (shielded != 0) {
            Py_DECREF(taken);
            if (shielded < 0) {
                return NULL;
            }
            Py_RETURN_NONE;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_DelItem(order, PyTuple_GET_ITEM(PyList_GET_ITEM(taken, i), 0)) < 0) {
            Py_DECREF(taken);
            return NULL;
        }
    }
    return taken;
}

static PyMethodDef block_loops_methods[] = {
    {"leading_ready", (PyCFunction)(void (*)(void))leading_ready, METH_FASTCALL,
     "leading_ready($module, blocks, keys, /)\n--\n\nHow many leading keys are held ready."},
    {"pin_all", (PyCFunction)(void (*)(void))pin_all, METH_FASTCALL,
     "pin_all($module, blocks, keys, /)\n--\n\nPin every key's block: (ids, newly pinned), or the refused key's index."},
    {"unpin_all", (PyCFunction)(void (*)(void))unpin_all, METH_FASTCALL,
     "unpin_all($module, blocks, keys, /)\n--\n\nUnpin every key's block: the keys unpinned, or the refused key's index."},
    {"mark_ready", (PyCFunction)(void (*)(void))mark_ready, METH_FASTCALL,
     "mark_ready($module, blocks, keys, /)\n--\n\nThe pending blocks among keys made ready: their keys."},
    {"drop_victims", (PyCFunction)(void (*)(void))drop_victims, METH_FASTCALL,
     "drop_victims($module, blocks, victims, free, /)\n--\n\nForget the victims, free their blocks: their keys."},
    {"claim_pending", claim_pending, METH_O,
     "claim_pending($module, blocks, /)\n--\n\nMark the blocks pending: their ids."},
    {"move_recent", (PyCFunction)(void (*)(void))move_recent, METH_FASTCALL,
     "move_recent($module, order, parking, keys, /)\n--\n\nMake keys recent, the first most recent."},
    {"store_pairs", (PyCFunction)(void (*)(void))store_pairs, METH_FASTCALL,
     "store_pairs($module, mapping, keys, values, /)\n--\n\nmapping[key] = value, pairwise, in order (the lengths must match)."},
    {"distinct", distinct, METH_O,
     "distinct($module, keys, /)\n--\n\nThe keys, each once, where it first comes."},
    {"front_victims", (PyCFunction)(void (*)(void))front_victims, METH_FASTCALL,
     "front_victims($module, order, n, protected, /)\n--\n\nThe first n blocks, taken out, where each is a victim; else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef block_loops_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvoffload.policies._block_loops",
    .m_doc = "The real tier's per-key loops in C (block_loops.py is the reference).",
    .m_size = -1,
    .m_methods = block_loops_methods,
};

PyMODINIT_FUNC
PyInit__block_loops(void)
{
    name_ref_cnt = PyUnicode_InternFromString("ref_cnt");
    name_block_id = PyUnicode_InternFromString("block_id");
    name_move_to_end = PyUnicode_InternFromString("move_to_end");
    name_unpark = PyUnicode_InternFromString("unpark");
    name_parked = PyUnicode_InternFromString("parked");
    if (!name_ref_cnt || !name_block_id || !name_move_to_end || !name_unpark || !name_parked) {
        return NULL;
    }
    return PyModule_Create(&block_loops_module);
}
