/* The block pool's state in flat arrays: shoal.engine.core._native_block_pool (see
 * block_pool_arrays.py for the same thing in Python, and block_pool.py for the semantics both
 * keep: the free queue, reference counts and the prefix-cache map).
 *
 * Per block: a reference count, the free queue's links (ids, -1 when not queued; two sentinels
 * past the last block) and its hash (up to 32 bytes, copied in). The prefix-cache map is an
 * open-addressed table of block ids with each key's 64-bit digest beside it, linear probing,
 * backward-shift deletion (no tombstones), at most half full. For 20,000 blocks the whole state
 * is ~1.5 MB, where the Python objects it replaces (a block object, a dict entry and a bytes key
 * each) were scattered over the heap: a wave of ~500 blocks taken, cached and freed ran at
 * ~350 + 220 + 140 ns a block, most of it cache misses.
 *
 * Built by setup.py as an optional extension (no compiler: the Python arrays run instead). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_KEY 32
#define EMPTY (-1)

typedef struct {
  PyObject_HEAD
  int32_t num_blocks, num_free, map_mask, map_used;
  int32_t *ref;       /* [num_blocks] */
  int32_t *prev;      /* [num_blocks + 2]: EMPTY when not in the free queue */
  int32_t *next;      /* [num_blocks + 2] */
  uint8_t *key_len;   /* [num_blocks]: 0 = no hash */
  uint8_t *keys;      /* [num_blocks][MAX_KEY] */
  uint64_t *digest;   /* [num_blocks]: the key's digest */
  int32_t *map;       /* [map_mask + 1]: block ids, EMPTY */
} Pool;

#define HEAD(p) ((p)->num_blocks)
#define TAIL(p) ((p)->num_blocks + 1)

static uint64_t digest_of(const uint8_t *key, Py_ssize_t len) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)len;
  for (Py_ssize_t at = 0; at < len; at += 8) {
    uint64_t word = 0;
    memcpy(&word, key + at, len - at < 8 ? (size_t)(len - at) : 8);
    h = (h ^ word) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  h ^= h >> 30;
  h *= 0x94D049BB133111EBull;
  return h ^ (h >> 31);
}

/* ----- the free queue */

static void unlink_block(Pool *p, int32_t id) {
  const int32_t before = p->prev[id], after = p->next[id];
  p->next[before] = after;
  p->prev[after] = before;
  p->prev[id] = p->next[id] = EMPTY;
  p->num_free--;
}

static void push_back(Pool *p, int32_t id) {
  const int32_t last = p->prev[TAIL(p)];
  p->next[last] = id;
  p->prev[id] = last;
  p->next[id] = TAIL(p);
  p->prev[TAIL(p)] = id;
  p->num_free++;
}

static void push_front(Pool *p, int32_t id) {
  const int32_t first = p->next[HEAD(p)];
  p->prev[first] = id;
  p->next[id] = first;
  p->prev[id] = HEAD(p);
  p->next[HEAD(p)] = id;
  p->num_free++;
}

/* ----- the prefix-cache map */

static int same_key(const Pool *p, int32_t id, const uint8_t *key, Py_ssize_t len, uint64_t h) {
  return p->digest[id] == h && p->key_len[id] == len && memcmp(p->keys + (size_t)id * MAX_KEY, key, len) == 0;
}

/* The map's slot holding `key`, or the empty slot where it would go. */
static int32_t find_slot(const Pool *p, const uint8_t *key, Py_ssize_t len, uint64_t h) {
  int32_t slot = (int32_t)(h & (uint64_t)p->map_mask);
  while (p->map[slot] != EMPTY && !same_key(p, p->map[slot], key, len, h))
    slot = (slot + 1) & p->map_mask;
  return slot;
}

static void remove_slot(Pool *p, int32_t slot) {
  /* Backward shift: later entries of the probe run move up into the hole where they may. */
  int32_t hole = slot, at = slot;
  for (;;) {
    at = (at + 1) & p->map_mask;
    const int32_t id = p->map[at];
    if (id == EMPTY) break;
    const int32_t home = (int32_t)(p->digest[id] & (uint64_t)p->map_mask);
    /* `id` may fill the hole when its home is not cyclically within (hole, at]. */
    const int fits = hole <= at ? (home <= hole || home > at) : (home <= hole && home > at);
    if (fits) {
      p->map[hole] = id;
      hole = at;
    }
  }
  p->map[hole] = EMPTY;
  p->map_used--;
}

static PyObject *key_bytes(const Pool *p, int32_t id) {
  return PyBytes_FromStringAndSize((const char *)p->keys + (size_t)id * MAX_KEY, p->key_len[id]);
}

/* Forget block `id`'s hash; where the map names this block for it, the entry goes too (and, with
 * `removed` a list, the hash is appended to it). -1 on a Python error. */
static int drop_hash(Pool *p, int32_t id, PyObject *removed) {
  if (!p->key_len[id]) return 0;
  const uint8_t *key = p->keys + (size_t)id * MAX_KEY;
  const int32_t slot = find_slot(p, key, p->key_len[id], p->digest[id]);
  if (p->map[slot] == id) {
    if (removed != Py_None) {
      PyObject *gone = key_bytes(p, id);
      if (!gone || PyList_Append(removed, gone) < 0) {
        Py_XDECREF(gone);
        return -1;
      }
      Py_DECREF(gone);
    }
    remove_slot(p, slot);
  }
  p->key_len[id] = 0;
  return 0;
}

/* ----- argument helpers */

static int read_key(PyObject *obj, const uint8_t **key, Py_ssize_t *len) {
  if (!PyBytes_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "a block hash must be bytes, not %.100s", Py_TYPE(obj)->tp_name);
    return -1;
  }
  *len = PyBytes_GET_SIZE(obj);
  if (*len < 1 || *len > MAX_KEY) {
    PyErr_Format(PyExc_ValueError, "a block hash must be 1 to %d bytes, got %zd", MAX_KEY, *len);
    return -1;
  }
  *key = (const uint8_t *)PyBytes_AS_STRING(obj);
  return 0;
}

static int read_id(const Pool *p, PyObject *obj, int32_t *id) {
  const long value = PyLong_AsLong(obj);
  if (value == -1 && PyErr_Occurred()) return -1;
  if (value < 0 || value >= p->num_blocks) {
    PyErr_Format(PyExc_IndexError, "block id %ld out of range [0, %d)", value, p->num_blocks);
    return -1;
  }
  *id = (int32_t)value;
  return 0;
}

static int check_args(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
  if (nargs == want) return 0;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
  return -1;
}

/* Ascending ids, in place: insertion sort for a few, else a radix sort by bytes. */
static int sort_ids(int32_t *ids, Py_ssize_t n, int32_t num_blocks) {
  if (n <= 32) {
    for (Py_ssize_t i = 1; i < n; i++) {
      const int32_t v = ids[i];
      Py_ssize_t j = i;
      for (; j > 0 && ids[j - 1] > v; j--) ids[j] = ids[j - 1];
      ids[j] = v;
    }
    return 0;
  }
  int32_t *spare = PyMem_Malloc(sizeof(int32_t) * n);
  if (!spare) return -1;
  int32_t *from = ids, *to = spare;
  for (int shift = 0; shift < 32 && (num_blocks >> shift) > 0; shift += 8) {
    Py_ssize_t count[257] = {0};
    for (Py_ssize_t i = 0; i < n; i++) count[((from[i] >> shift) & 255) + 1]++;
    for (int b = 0; b < 256; b++) count[b + 1] += count[b];
    for (Py_ssize_t i = 0; i < n; i++) to[count[(from[i] >> shift) & 255]++] = from[i];
    int32_t *swap = from;
    from = to;
    to = swap;
  }
  if (from != ids) memcpy(ids, from, sizeof(int32_t) * n);
  PyMem_Free(spare);
  return 0;
}

static PyObject *id_list(const int32_t *ids, Py_ssize_t n) {
  PyObject *out = PyList_New(n);
  if (!out) return NULL;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *v = PyLong_FromLong(ids[i]);
    if (!v) {
      Py_DECREF(out);
      return NULL;
    }
    PyList_SET_ITEM(out, i, v);
  }
  return out;
}

/* ----- methods */

/* take(count, removed) -> list[int]: `count` blocks from the front of the free queue, in
 * ascending id order, one reference each, their old hashes evicted (appended to `removed` where
 * it is a list and the map named the block). The caller checked there are that many. */
static PyObject *Pool_take(Pool *p, PyObject *const *args, Py_ssize_t nargs) {
  if (check_args(nargs, 2, "take") < 0) return NULL;
  const Py_ssize_t count = PyLong_AsSsize_t(args[0]);
  if (count == -1 && PyErr_Occurred()) return NULL;
  if (count < 0 || count > p->num_free)
    return PyErr_Format(PyExc_ValueError, "cannot take %zd blocks, only %d free", count, p->num_free);
  int32_t *ids = PyMem_Malloc(sizeof(int32_t) * (count ? count : 1));
  if (!ids) return PyErr_NoMemory();
  for (Py_ssize_t i = 0; i < count; i++) {
    ids[i] = p->next[HEAD(p)];
    unlink_block(p, ids[i]);
    p->ref[ids[i]] = 1;
  }
  /* Ascending ids: a request's consecutive positions get consecutive rows where they can (blocks
   * freed tail first come back descending), so a worker copies a run of them to or from an
   * offload tier in one pass. */
  PyObject *out = NULL;
  if (sort_ids(ids, count, p->num_blocks) < 0) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < count; i++)
    if (drop_hash(p, ids[i], args[1]) < 0) goto done;
  out = id_list(ids, count);
done:
  PyMem_Free(ids);
  return out;
}

/* lookup(key) -> int: the block the map names for `key`, or -1. */
static PyObject *Pool_lookup(Pool *p, PyObject *key_obj) {
  const uint8_t *key;
  Py_ssize_t len;
  if (read_key(key_obj, &key, &len) < 0) return NULL;
  const int32_t slot = find_slot(p, key, len, digest_of(key, len));
  return PyLong_FromLong(p->map[slot]);
}

/* lookup_prefix(keys) -> list[int]: the blocks of the longest run of `keys`, from the first,
 * that the map holds. */
static PyObject *Pool_lookup_prefix(Pool *p, PyObject *keys_obj) {
  PyObject *keys = PySequence_Fast(keys_obj, "keys must be a sequence");
  if (!keys) return NULL;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
  PyObject **items = PySequence_Fast_ITEMS(keys);
  PyObject *out = PyList_New(0);
  for (Py_ssize_t i = 0; out && i < n; i++) {
    const uint8_t *key;
    Py_ssize_t len;
    if (read_key(items[i], &key, &len) < 0) {
      Py_CLEAR(out);
      break;
    }
    const int32_t id = p->map[find_slot(p, key, len, digest_of(key, len))];
    if (id == EMPTY) break;
    PyObject *v = PyLong_FromLong(id);
    if (!v || PyList_Append(out, v) < 0) Py_CLEAR(out);
    Py_XDECREF(v);
  }
  Py_DECREF(keys);
  return out;
}

/* cache(ids, keys, added) -> None: block ids[i] holds the tokens keys[i] names; the map takes
 * each key not in it yet (the first block keeps a key). With `added` a list, one bool a key:
 * whether the map took it. */
static PyObject *Pool_cache(Pool *p, PyObject *const *args, Py_ssize_t nargs) {
  if (check_args(nargs, 3, "cache") < 0) return NULL;
  PyObject *ids = PySequence_Fast(args[0], "ids must be a sequence");
  if (!ids) return NULL;
  PyObject *keys = PySequence_Fast(args[1], "keys must be a sequence");
  if (!keys) {
    Py_DECREF(ids);
    return NULL;
  }
  PyObject *added = args[2], *result = NULL;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
  if (PySequence_Fast_GET_SIZE(keys) != n) {
    PyErr_SetString(PyExc_ValueError, "cache: as many keys as blocks");
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    int32_t id;
    const uint8_t *key;
    Py_ssize_t len;
    if (read_id(p, PySequence_Fast_GET_ITEM(ids, i), &id) < 0) goto done;
    if (read_key(PySequence_Fast_GET_ITEM(keys, i), &key, &len) < 0) goto done;
    const uint64_t h = digest_of(key, len);
    if (!(p->key_len[id] && same_key(p, id, key, len, h)) && drop_hash(p, id, Py_None) < 0)
      goto done;
    memcpy(p->keys + (size_t)id * MAX_KEY, key, len);
    p->key_len[id] = (uint8_t)len;
    p->digest[id] = h;
    const int32_t slot = find_slot(p, key, len, h);
    const int taken = p->map[slot] == EMPTY;
    if (taken) {
      p->map[slot] = id;
      p->map_used++;
    }
    if (added != Py_None && PyList_Append(added, taken ? Py_True : Py_False) < 0) goto done;
  }
  result = Py_NewRef(Py_None);
done:
  Py_DECREF(ids);
  Py_DECREF(keys);
  return result;
}

/* touch(ids) -> None: one more reference each; a free block leaves the free queue. */
static PyObject *Pool_touch(Pool *p, PyObject *ids_obj) {
  PyObject *ids = PySequence_Fast(ids_obj, "ids must be a sequence");
  if (!ids) return NULL;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
  for (Py_ssize_t i = 0; i < n; i++) {
    int32_t id;
    if (read_id(p, PySequence_Fast_GET_ITEM(ids, i), &id) < 0) {
      Py_DECREF(ids);
      return NULL;
    }
    if (p->ref[id] == 0 && p->prev[id] != EMPTY) unlink_block(p, id);
    p->ref[id]++;
  }
  Py_DECREF(ids);
  Py_RETURN_NONE;
}

/* free(ids, drop_cached, removed) -> None: one reference less each, in order; blocks reaching
 * zero become free, unhashed ones at the front (the last of them first), hashed ones at the
 * back. `drop_cached` forgets the hashes of the blocks that become free (evicted ones appended to
 * `removed` where it is a list). */
static PyObject *Pool_free(Pool *p, PyObject *const *args, Py_ssize_t nargs) {
  if (check_args(nargs, 3, "free") < 0) return NULL;
  const int drop_cached = PyObject_IsTrue(args[1]);
  if (drop_cached < 0) return NULL;
  PyObject *ids = PySequence_Fast(args[0], "ids must be a sequence");
  if (!ids) return NULL;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
  int32_t *freed = PyMem_Malloc(sizeof(int32_t) * (n ? n : 1));
  if (!freed) {
    Py_DECREF(ids);
    return PyErr_NoMemory();
  }
  Py_ssize_t num_freed = 0;
  PyObject *result = Py_None;
  for (Py_ssize_t i = 0; i < n; i++) {
    int32_t id;
    if (read_id(p, PySequence_Fast_GET_ITEM(ids, i), &id) < 0) {
      result = NULL;
      break;
    }
    if (p->ref[id] <= 0) {
      PyErr_Format(PyExc_ValueError, "block %d freed with no reference held", id);
      result = NULL;
      break;
    }
    if (--p->ref[id]) continue;
    freed[num_freed++] = id;
    if (drop_cached && drop_hash(p, id, args[2]) < 0) {
      result = NULL;
      break;
    }
  }
  /* (Also after an error: the blocks that reached zero are queued, none is lost.) Front first,
   * in order, so the last unhashed one ends up taken first; then the back. */
  for (Py_ssize_t i = 0; i < num_freed; i++)
    if (!p->key_len[freed[i]]) push_front(p, freed[i]);
  for (Py_ssize_t i = 0; i < num_freed; i++)
    if (p->key_len[freed[i]]) push_back(p, freed[i]);
  Py_XINCREF(result);
  PyMem_Free(freed);
  Py_DECREF(ids);
  return result;
}

static PyObject *Pool_ref_cnt(Pool *p, PyObject *id_obj) {
  int32_t id;
  if (read_id(p, id_obj, &id) < 0) return NULL;
  return PyLong_FromLong(p->ref[id]);
}

/* block_hash(id) -> bytes | None */
static PyObject *Pool_block_hash(Pool *p, PyObject *id_obj) {
  int32_t id;
  if (read_id(p, id_obj, &id) < 0) return NULL;
  if (!p->key_len[id]) Py_RETURN_NONE;
  return key_bytes(p, id);
}

/* count_free(ids) -> int: how many of the blocks nobody references (free, or the null block). */
static PyObject *Pool_count_free(Pool *p, PyObject *ids_obj) {
  PyObject *ids = PySequence_Fast(ids_obj, "ids must be a sequence");
  if (!ids) return NULL;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
  long count = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    int32_t id;
    if (read_id(p, PySequence_Fast_GET_ITEM(ids, i), &id) < 0) {
      Py_DECREF(ids);
      return NULL;
    }
    count += p->ref[id] == 0;
  }
  Py_DECREF(ids);
  return PyLong_FromLong(count);
}

/* free_ids() -> list[int]: the free queue, front (taken first) to back. */
static PyObject *Pool_free_ids(Pool *p, PyObject *Py_UNUSED(ignored)) {
  PyObject *out = PyList_New(0);
  for (int32_t id = p->next[HEAD(p)]; out && id != TAIL(p); id = p->next[id]) {
    PyObject *v = PyLong_FromLong(id);
    if (!v || PyList_Append(out, v) < 0) Py_CLEAR(out);
    Py_XDECREF(v);
  }
  return out;
}

/* cached_keys() -> list[bytes]: every key in the map. */
static PyObject *Pool_cached_keys(Pool *p, PyObject *Py_UNUSED(ignored)) {
  PyObject *out = PyList_New(0);
  for (int32_t slot = 0; out && slot <= p->map_mask; slot++) {
    if (p->map[slot] == EMPTY) continue;
    PyObject *key = key_bytes(p, p->map[slot]);
    if (!key || PyList_Append(out, key) < 0) Py_CLEAR(out);
    Py_XDECREF(key);
  }
  return out;
}

/* clear_hashes() -> None: every block's hash and the whole map forgotten. */
static PyObject *Pool_clear_hashes(Pool *p, PyObject *Py_UNUSED(ignored)) {
  memset(p->key_len, 0, p->num_blocks);
  for (int32_t slot = 0; slot <= p->map_mask; slot++) p->map[slot] = EMPTY;
  p->map_used = 0;
  Py_RETURN_NONE;
}

static PyObject *Pool_get_num_free(Pool *p, void *Py_UNUSED(closure)) {
  return PyLong_FromLong(p->num_free);
}

static PyObject *Pool_get_num_cached(Pool *p, void *Py_UNUSED(closure)) {
  return PyLong_FromLong(p->map_used);
}

static int Pool_init(Pool *p, PyObject *args, PyObject *kwargs) {
  int num_blocks;
  static char *names[] = {"num_blocks", NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i", names, &num_blocks)) return -1;
  if (num_blocks < 2 || num_blocks > (1 << 30)) {
    PyErr_Format(PyExc_ValueError, "num_blocks must be 2 to 2**30, got %d", num_blocks);
    return -1;
  }
  if (p->ref) {
    PyErr_SetString(PyExc_RuntimeError, "a pool is initialized once");
    return -1;
  }
  int32_t capacity = 8;
  while (capacity < 2 * num_blocks) capacity *= 2;
  p->num_blocks = num_blocks;
  p->map_mask = capacity - 1;
  p->ref = PyMem_Calloc(num_blocks, sizeof(int32_t));
  p->prev = PyMem_Malloc(sizeof(int32_t) * (num_blocks + 2));
  p->next = PyMem_Malloc(sizeof(int32_t) * (num_blocks + 2));
  p->key_len = PyMem_Calloc(num_blocks, 1);
  p->keys = PyMem_Malloc((size_t)num_blocks * MAX_KEY);
  p->digest = PyMem_Calloc(num_blocks, sizeof(uint64_t));
  p->map = PyMem_Malloc(sizeof(int32_t) * capacity);
  if (!p->ref || !p->prev || !p->next || !p->key_len || !p->keys || !p->digest || !p->map) {
    PyErr_NoMemory();
    return -1;
  }
  for (int32_t slot = 0; slot < capacity; slot++) p->map[slot] = EMPTY;
  for (int32_t id = 0; id < num_blocks + 2; id++) p->prev[id] = p->next[id] = EMPTY;
  p->next[HEAD(p)] = TAIL(p);
  p->prev[TAIL(p)] = HEAD(p);
  p->num_free = 0;
  for (int32_t id = 1; id < num_blocks; id++) push_back(p, id); /* block 0: the null block */
  return 0;
}

static void Pool_dealloc(Pool *p) {
  PyMem_Free(p->ref);
  PyMem_Free(p->prev);
  PyMem_Free(p->next);
  PyMem_Free(p->key_len);
  PyMem_Free(p->keys);
  PyMem_Free(p->digest);
  PyMem_Free(p->map);
  Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef Pool_methods[] = {
    {"take", (PyCFunction)(void (*)(void))Pool_take, METH_FASTCALL, NULL},
    {"lookup", (PyCFunction)Pool_lookup, METH_O, NULL},
    {"lookup_prefix", (PyCFunction)Pool_lookup_prefix, METH_O, NULL},
    {"cache", (PyCFunction)(void (*)(void))Pool_cache, METH_FASTCALL, NULL},
    {"touch", (PyCFunction)Pool_touch, METH_O, NULL},
    {"free", (PyCFunction)(void (*)(void))Pool_free, METH_FASTCALL, NULL},
    {"ref_cnt", (PyCFunction)Pool_ref_cnt, METH_O, NULL},
    {"block_hash", (PyCFunction)Pool_block_hash, METH_O, NULL},
    {"count_free", (PyCFunction)Pool_count_free, METH_O, NULL},
    {"free_ids", (PyCFunction)Pool_free_ids, METH_NOARGS, NULL},
    {"cached_keys", (PyCFunction)Pool_cached_keys, METH_NOARGS, NULL},
    {"clear_hashes", (PyCFunction)Pool_clear_hashes, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"num_free", (getter)Pool_get_num_free, NULL, NULL, NULL},
    {"num_cached", (getter)Pool_get_num_cached, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shoal.engine.core._native_block_pool.NativeBlockArrays",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A block pool's free queue, reference counts and prefix-cache map, in flat arrays.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native_block_pool",
    "The block pool's arrays in C (engine/core/native_block_pool.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__native_block_pool(void) {
  if (PyType_Ready(&PoolType) < 0) return NULL;
  PyObject *m = PyModule_Create(&module);
  if (!m) return NULL;
  if (PyModule_AddObjectRef(m, "NativeBlockArrays", (PyObject *)&PoolType) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
