/* The session's kept path in C: see NOTE [ Fast path ] in tensorstash/core/_fastpath.py.
 *
 * Three types, each with a pure-Python twin that behaves the same:
 *   HotCounts  the counts the pack hook keeps without a lock (stats.HotCounts);
 *   Kept       a tensor kept where it is (values.Kept);
 *   Hooks      pack and unpack for a session whose common case is C's:
 *              anything else is handed to the session's own Python hooks.
 *
 * Only the CPython API is used (no torch headers): a tensor's fields are
 * read through its Python attributes, as the Python path reads them.
 * Everything here runs with the GIL held; a Kept freed on another thread
 * (backward on a device's thread) adds its bytes to ``released`` under it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* -- interned names ------------------------------------------------------------------- */

static PyObject *s_nbytes, *s_grad_fn, *s_sequence_nr, *s_detach, *s_version, *s_requires_grad,
    *s_base, *s_is_leaf, *s_data_ptr, *s_reread, *s_stack, *s_live_bytes, *s_last,
    *s_sweep_at, *s_sweep, *s_is_cpu;

/* -- a tensor's fields ----------------------------------------------------------------- */

/* The getters of torch.Tensor's C fields, called directly for a plain Tensor: what
 * PyObject_GetAttr calls after looking them up (the same getter, the same checks). */
enum { F_NBYTES, F_GRAD_FN, F_VERSION, F_BASE, F_REQUIRES_GRAD, F_IS_CPU, F_COUNT };

static struct {
    PyObject **name;
    getter get;
    void *closure;
} fields[F_COUNT] = {
    {&s_nbytes}, {&s_grad_fn}, {&s_version}, {&s_base}, {&s_requires_grad}, {&s_is_cpu},
};
static PyObject *fields_of; /* the type whose getters ``fields`` holds */

static int resolve_fields(PyObject *tensor_type) {
    if (fields_of == tensor_type)
        return 0;
    for (int i = 0; i < F_COUNT; i++) {
        PyObject *descr = PyObject_GetAttr(tensor_type, *fields[i].name);
        if (descr == NULL)
            return -1;
        if (Py_IS_TYPE(descr, &PyGetSetDescr_Type)) {
            PyGetSetDef *def = ((PyGetSetDescrObject *)descr)->d_getset;
            fields[i].get = def->get;
            fields[i].closure = def->closure;
        } else {
            fields[i].get = NULL; /* a Python property: read it as an attribute */
        }
        Py_DECREF(descr);
    }
    Py_INCREF(tensor_type);
    Py_XSETREF(fields_of, tensor_type);
    return 0;
}

static PyObject *field(PyObject *tensor, int which) {
    if ((PyObject *)Py_TYPE(tensor) == fields_of && fields[which].get != NULL)
        return fields[which].get(tensor, fields[which].closure);
    return PyObject_GetAttr(tensor, *fields[which].name);
}

/* -- HotCounts ------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_ssize_t small_tensors, small_bytes, tensors, bytes, live, peak, unpacks, released;
    Py_ssize_t keep_limit, keep_left; /* a selector's keep limit (rule 5 of the NOTE) */
    char keep_cpu;
} HotObject;

static PyTypeObject HotType;

static PyObject *Hot_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "HotCounts() takes no arguments");
        return NULL;
    }
    HotObject *self = (HotObject *)type->tp_alloc(type, 0); /* zeroed */
    if (self != NULL)
        self->keep_limit = -1;
    return (PyObject *)self;
}

static PyObject *Hot_release(HotObject *self, PyObject *nbytes) {
    Py_ssize_t n = PyLong_AsSsize_t(nbytes);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    self->released += n;
    Py_RETURN_NONE;
}

/* Take the bytes of freed kept tensors off ``live`` (on the hooks' thread). */
static inline void hot_drain(HotObject *self) {
    self->live -= self->released;
    self->released = 0;
}

static PyObject *Hot_drain(HotObject *self, PyObject *unused) {
    hot_drain(self);
    Py_RETURN_NONE;
}

static PyObject *Hot_pending(HotObject *self, PyObject *unused) {
    return PyLong_FromSsize_t(self->released);
}

/* post(limit, on_cpu, count): a selector's keep limit (rule 5 of the NOTE). */
static PyObject *Hot_post(HotObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "HotCounts.post takes (limit, on_cpu, count)");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[0]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    int on_cpu = PyObject_IsTrue(args[1]);
    if (on_cpu < 0)
        return NULL;
    Py_ssize_t count = PyLong_AsSsize_t(args[2]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    self->keep_limit = limit;
    self->keep_cpu = (char)on_cpu;
    self->keep_left = count;
    Py_RETURN_NONE;
}

static PyObject *Hot_unpost(HotObject *self, PyObject *unused) {
    self->keep_left = 0;
    Py_RETURN_NONE;
}

static PyMethodDef Hot_methods[] = {
    {"post", (PyCFunction)(void (*)(void))Hot_post, METH_FASTCALL,
     "Let the C pack keep ``count`` tensors (on the CPU or not) while ``live`` stays within "
     "``limit``, without asking the selector."},
    {"unpost", (PyCFunction)Hot_unpost, METH_NOARGS, "Withdraw what was posted."},
    {"release", (PyCFunction)Hot_release, METH_O,
     "Post the bytes of a kept tensor freed (on any thread)."},
    {"drain", (PyCFunction)Hot_drain, METH_NOARGS,
     "Take the bytes of freed kept tensors off ``live``."},
    {"pending", (PyCFunction)Hot_pending, METH_NOARGS,
     "The bytes of freed kept tensors not yet taken off ``live``."},
    {NULL},
};

#define HOT_MEMBER(name) {#name, T_PYSSIZET, offsetof(HotObject, name), 0, NULL}
static PyMemberDef Hot_members[] = {
    HOT_MEMBER(small_tensors), HOT_MEMBER(small_bytes), HOT_MEMBER(tensors),
    HOT_MEMBER(bytes),         HOT_MEMBER(live),        HOT_MEMBER(peak),
    HOT_MEMBER(unpacks),       HOT_MEMBER(keep_limit),  HOT_MEMBER(keep_left),
    {"keep_cpu", T_BOOL, offsetof(HotObject, keep_cpu), 0, NULL},
    {"released", T_PYSSIZET, offsetof(HotObject, released), READONLY, NULL},
    {NULL},
};

static PyTypeObject HotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tensorstash.core._fast.HotCounts",
    .tp_basicsize = sizeof(HotObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What the pack hook counts without a lock (see stats.HotCounts).",
    .tp_new = Hot_new,
    .tp_methods = Hot_methods,
    .tp_members = Hot_members,
};

/* -- Kept ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *tensor;
    PyObject *version;
    PyObject *prev;
    HotObject *hot;
    Py_ssize_t nbytes;
    PyObject *weakrefs;
} KeptObject;

static PyTypeObject KeptType;

/* Steals nothing; every argument is borrowed. */
static KeptObject *kept_make(PyObject *tensor, PyObject *version, Py_ssize_t nbytes,
                             HotObject *hot, PyObject *prev) {
    KeptObject *self = PyObject_New(KeptObject, &KeptType);
    if (self == NULL)
        return NULL;
    Py_INCREF(tensor);
    self->tensor = tensor;
    Py_INCREF(version);
    self->version = version;
    Py_INCREF(prev);
    self->prev = prev;
    Py_INCREF(hot);
    self->hot = hot;
    self->nbytes = nbytes;
    self->weakrefs = NULL;
    return self;
}

static PyObject *Kept_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *tensor, *version, *hot, *prev;
    Py_ssize_t nbytes;
    static char *names[] = {"tensor", "version", "nbytes", "hot", "prev", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOnO!O:Kept", names, &tensor, &version,
                                     &nbytes, &HotType, &hot, &prev))
        return NULL;
    return (PyObject *)kept_make(tensor, version, nbytes, (HotObject *)hot, prev);
}

static void Kept_dealloc(KeptObject *self) {
    /* Rule 7 of NOTE [ Session ]: the graph freed this; post its bytes. */
    self->hot->released += self->nbytes;
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    Py_DECREF(self->tensor);
    Py_DECREF(self->version);
    Py_DECREF(self->prev);
    Py_DECREF(self->hot);
    PyObject_Free(self);
}

/* Whether ``tensor`` changed in place since it was saved at ``version`` (rule 2):
 * 1, 0, or -1 on an error. */
static int changed_since(PyObject *tensor, PyObject *version) {
    PyObject *now = field(tensor, F_VERSION);
    if (now == NULL)
        return -1;
    int same = PyObject_RichCompareBool(now, version, Py_EQ);
    Py_DECREF(now);
    return same < 0 ? -1 : !same;
}

static PyObject *Kept_changed(KeptObject *self, PyObject *unused) {
    int changed = changed_since(self->tensor, self->version);
    if (changed < 0)
        return NULL;
    return PyBool_FromLong(changed);
}

static PyObject *Kept_geometry(KeptObject *self, PyObject *unused) {
    PyObject *offset = PyObject_CallMethod(self->tensor, "storage_offset", NULL);
    PyObject *shape = PyObject_GetAttrString(self->tensor, "shape");
    PyObject *stride = PyObject_CallMethod(self->tensor, "stride", NULL);
    PyObject *dtype = PyObject_GetAttrString(self->tensor, "dtype");
    PyObject *result = NULL;
    if (offset && shape && stride && dtype)
        result = PyTuple_Pack(5, offset, shape, stride, dtype, self->version);
    Py_XDECREF(offset);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(dtype);
    return result;
}

static PyMethodDef Kept_methods[] = {
    {"changed", (PyCFunction)Kept_changed, METH_NOARGS,
     "Whether the tensor changed in place since it was saved."},
    {"geometry", (PyCFunction)Kept_geometry, METH_NOARGS,
     "(storage offset, shape, stride, dtype, version): what dedupe compares."},
    {NULL},
};

static PyMemberDef Kept_members[] = {
    {"tensor", T_OBJECT, offsetof(KeptObject, tensor), READONLY, NULL},
    {"version", T_OBJECT, offsetof(KeptObject, version), READONLY, NULL},
    {"prev", T_OBJECT, offsetof(KeptObject, prev), READONLY, NULL},
    {"hot", T_OBJECT, offsetof(KeptObject, hot), READONLY, NULL},
    {"nbytes", T_PYSSIZET, offsetof(KeptObject, nbytes), READONLY, NULL},
    {NULL},
};

static PyTypeObject KeptType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tensorstash.core._fast.Kept",
    .tp_basicsize = sizeof(KeptObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A tensor kept where it is, as autograd holds it (see values.Kept).",
    .tp_new = Kept_new,
    .tp_dealloc = (destructor)Kept_dealloc,
    .tp_weaklistoffset = offsetof(KeptObject, weakrefs),
    .tp_methods = Kept_methods,
    .tp_members = Kept_members,
};

/* -- Hooks ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *owner;         /* the Session: only told apart from others, never called */
    PyObject *pack_slow;     /* the session's Python pack hook */
    PyObject *unpack_slow;   /* the session's Python unpack hook */
    HotObject *hot;
    PyObject *kept_tier;     /* stats.tiers["kept"]: live_bytes */
    PyObject *dedupe;        /* values.Dedupe: sweep_at, sweep() */
    PyObject *values;        /* its dict: address -> weakref or list */
    PyObject *state;         /* _modules._state: address -> parameter or buffer */
    PyObject *thread;        /* _modules._Thread of the session's thread */
    PyObject *policy;        /* the session's policy */
    PyObject *choose;        /* the selector's choose, or None */
    PyObject *ctx;           /* the session's Context */
    PyObject *tensor_type;   /* torch.Tensor */
    PyObject *parameter_type;
    PyObject *keep_type;     /* policy.Keep */
    PyObject *copies;        /* frozenset of the node types of parameter copies */
    PyObject *sequence_nr;   /* torch._C._autograd._get_sequence_nr */
    PyObject *pack_chosen;   /* (tensor, address, policy, why, record, wrapper): a policy packs */
    PyObject *prefetch;      /* (prev): bring back the packed values before a kept one */
    PyObject *order;         /* values.Order: ``last``, the value packed last */
    Py_ssize_t min_bytes;
    unsigned long pusher;    /* the thread that pushed the hooks: ``thread`` is its state */
} HooksObject;

static PyTypeObject HooksType;

/* The Hooks' references, in the order of Hooks_init's keyword arguments. */
static const Py_ssize_t hooks_refs[] = {
    offsetof(HooksObject, owner),          offsetof(HooksObject, pack_slow),
    offsetof(HooksObject, unpack_slow),    offsetof(HooksObject, hot),
    offsetof(HooksObject, kept_tier),      offsetof(HooksObject, dedupe),
    offsetof(HooksObject, values),         offsetof(HooksObject, state),
    offsetof(HooksObject, thread),         offsetof(HooksObject, policy),
    offsetof(HooksObject, choose),         offsetof(HooksObject, ctx),
    offsetof(HooksObject, tensor_type),    offsetof(HooksObject, parameter_type),
    offsetof(HooksObject, keep_type),      offsetof(HooksObject, copies),
    offsetof(HooksObject, sequence_nr),    offsetof(HooksObject, pack_chosen),
    offsetof(HooksObject, prefetch),       offsetof(HooksObject, order),
};
#define N_REFS ((int)(sizeof(hooks_refs) / sizeof(hooks_refs[0])))
#define HOOKS_REF(self, i) ((PyObject **)((char *)(self) + hooks_refs[i]))

static int Hooks_init(HooksObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"owner",       "pack",           "unpack",    "hot",
                            "kept_tier",   "dedupe",         "values",    "state",
                            "thread",      "policy",         "choose",    "ctx",
                            "tensor_type", "parameter_type", "keep_type", "copies",
                            "sequence_nr", "pack_chosen",    "prefetch",  "order",
                            "min_bytes",   NULL};
    PyObject *o[N_REFS];
    Py_ssize_t min_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OOOO!OOO!O!OOOOOOOO!OOOOn:Hooks", names,
                                     &o[0], &o[1], &o[2], &HotType, &o[3], &o[4], &o[5],
                                     &PyDict_Type, &o[6], &PyDict_Type, &o[7], &o[8], &o[9],
                                     &o[10], &o[11], &o[12], &o[13], &o[14], &PyFrozenSet_Type,
                                     &o[15], &o[16], &o[17], &o[18], &o[19], &min_bytes))
        return -1;
    for (int i = 0; i < N_REFS; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*HOOKS_REF(self, i), o[i]);
    }
    if (resolve_fields(self->tensor_type) < 0)
        return -1;
    self->min_bytes = min_bytes;
    self->pusher = PyThread_get_thread_ident();
    return 0;
}

static int Hooks_traverse(HooksObject *self, visitproc visit, void *arg) {
    for (int i = 0; i < N_REFS; i++)
        Py_VISIT(*HOOKS_REF(self, i));
    return 0;
}

static int Hooks_clear(HooksObject *self) {
    for (int i = 0; i < N_REFS; i++)
        Py_CLEAR(*HOOKS_REF(self, i));
    return 0;
}

static void Hooks_dealloc(HooksObject *self) {
    PyObject_GC_UnTrack(self);
    Hooks_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An integer attribute (or a method's result, call != 0) as a Py_ssize_t; -1 with an
 * error set on failure (callers clear it and take the slow path). */
static Py_ssize_t attr_ssize(PyObject *obj, PyObject *name, int call) {
    PyObject *value = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    if (n == -1 && !PyErr_Occurred())
        return -2; /* a real -1: never a size, an address or a sequence number here */
    return n;
}

/* Whether an attribute is true: 1, 0, or -1 on an error. */
static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

#define SLOW 1 /* hand the tensor to the Python hook */

/* Rule 1 of NOTE [ Session ] for a plain Tensor: what to hold of it (rules.held).
 * Sets *held (a new reference) and *grad_fn (new, maybe None); 0 or SLOW. */
static int held_of(HooksObject *self, PyObject *tensor, PyObject **held, PyObject **grad_fn) {
    *held = NULL;
    *grad_fn = field(tensor, F_GRAD_FN);
    if (*grad_fn == NULL)
        return SLOW;
    if (*grad_fn != Py_None) {
        Py_ssize_t mine = attr_ssize(*grad_fn, s_sequence_nr, 1);
        if (mine < 0)
            return SLOW;
        PyObject *next = PyObject_CallNoArgs(self->sequence_nr);
        if (next == NULL)
            return SLOW;
        Py_ssize_t last = PyLong_AsSsize_t(next) - 1;
        Py_DECREF(next);
        if (last == -2 && PyErr_Occurred())
            return SLOW;
        if (mine == last) {
            *held = PyObject_CallMethodNoArgs(tensor, s_detach);
            return *held == NULL ? SLOW : 0;
        }
    }
    Py_INCREF(tensor);
    *held = tensor;
    return 0;
}

/* Rule 1's eligibility past min_bytes (rules.ineligible): 0 eligible, SLOW otherwise. */
static int eligible(HooksObject *self, PyObject *tensor, PyObject *grad_fn) {
    if (grad_fn == Py_None) {
        PyObject *grad = field(tensor, F_REQUIRES_GRAD);
        int leaf = grad == NULL ? -1 : PyObject_IsTrue(grad);
        Py_XDECREF(grad);
        if (leaf != 0)
            return SLOW;
    } else {
        int copy = PySet_Contains(self->copies, (PyObject *)Py_TYPE(grad_fn));
        if (copy != 0)
            return SLOW;
    }
    PyObject *base = field(tensor, F_BASE);
    if (base == NULL)
        return SLOW;
    int verdict = 0;
    if (base != Py_None) {
        if ((PyObject *)Py_TYPE(base) == self->parameter_type)
            verdict = SLOW;
        else {
            int grad = attr_true(base, s_requires_grad);
            int leaf = grad == 1 ? attr_true(base, s_is_leaf) : grad;
            if (grad != 0 && leaf != 0)
                verdict = SLOW; /* a view of a leaf that requires grad, or an error */
        }
    }
    Py_DECREF(base);
    return verdict;
}

/* Whether the tensor at ``address`` may be module state: SLOW if so (or unknown), 0 not.
 * _modules.state_kind's miss, without its re-read: modules entered since the last
 * re-read send the tensor to the Python hook, which re-reads them. */
static int maybe_state(HooksObject *self, PyObject *address) {
    if (PyThread_get_thread_ident() != self->pusher)
        return SLOW; /* a pack on a backward thread: the Python hook reads that thread's modules */
    PyObject *found = PyDict_GetItemWithError(self->state, address);
    if (found != NULL || PyErr_Occurred())
        return SLOW;
    Py_ssize_t reread = attr_ssize(self->thread, s_reread, 0);
    if (reread < 0)
        return SLOW;
    PyObject *stack = PyObject_GetAttr(self->thread, s_stack);
    if (stack == NULL)
        return SLOW;
    Py_ssize_t depth = PyList_Check(stack) ? PyList_GET_SIZE(stack) : PY_SSIZE_T_MAX;
    Py_DECREF(stack);
    return reread >= depth ? 0 : SLOW;
}

/* Rule 3's add (values.Dedupe.add) for a new address: -1 on an error. */
static int dedupe_add(HooksObject *self, PyObject *value, PyObject *address) {
    PyObject *ref = PyWeakref_NewRef(value, NULL);
    if (ref == NULL)
        return -1;
    int failed = PyDict_SetItem(self->values, address, ref);
    Py_DECREF(ref);
    if (failed)
        return -1;
    if (PyDict_GET_SIZE(self->values) >= 1024) {
        Py_ssize_t sweep_at = attr_ssize(self->dedupe, s_sweep_at, 0);
        if (sweep_at < 0)
            return -1;
        if (PyDict_GET_SIZE(self->values) >= sweep_at) {
            PyObject *done = PyObject_CallMethodNoArgs(self->dedupe, s_sweep);
            if (done == NULL)
                return -1;
            Py_DECREF(done);
        }
    }
    return 0;
}

/* The kept path of Session.pack: a new reference, NULL with an error, or Py_None
 * (borrowed, not returned to Python) to hand the tensor to the Python hook. */
static PyObject *pack_fast(HooksObject *self, PyObject *tensor) {
    if ((PyObject *)Py_TYPE(tensor) != self->tensor_type)
        return Py_None; /* parameters, DTensors, other subclasses */
    PyObject *size = field(tensor, F_NBYTES);
    Py_ssize_t nbytes = size == NULL ? -1 : PyLong_AsSsize_t(size);
    Py_XDECREF(size);
    if (nbytes < 0) { /* sparse tensors have no plain size */
        PyErr_Clear();
        return Py_None;
    }
    PyObject *held, *grad_fn, *result = Py_None, *address = NULL, *version = NULL;
    int slow = held_of(self, tensor, &held, &grad_fn);
    if (slow)
        goto done;
    HotObject *hot = self->hot;
    if (nbytes < self->min_bytes) {
        version = field(tensor, F_VERSION);
        if (version == NULL)
            goto done;
        result = PyTuple_Pack(2, held, version);
        if (result != NULL) {
            hot->small_tensors += 1;
            hot->small_bytes += nbytes;
        }
        goto done;
    }
    if (eligible(self, tensor, grad_fn))
        goto done;
    address = PyObject_CallMethodNoArgs(tensor, s_data_ptr);
    if (address == NULL || !PyLong_CheckExact(address) || !PyObject_IsTrue(address))
        goto done; /* no storage (mkldnn, functorch wrappers), or no data */
    if (maybe_state(self, address))
        goto done;
    hot_drain(hot);
    if (nbytes) {
        PyObject *entry = PyDict_GetItemWithError(self->values, address);
        if (entry != NULL || PyErr_Occurred())
            goto done; /* seen before: the Python hook compares geometry (rule 3) */
    }
    version = field(tensor, F_VERSION);
    if (version == NULL)
        goto done;
    /* Rule 4: the selector's choice, or the policy; a selector's posted keep limit first. */
    int posted = 0;
    if (self->choose != Py_None && hot->keep_left > 0 && hot->live + nbytes <= hot->keep_limit) {
        PyObject *cpu = field(tensor, F_IS_CPU);
        int on_cpu = cpu == NULL ? -1 : PyObject_IsTrue(cpu);
        Py_XDECREF(cpu);
        if (on_cpu < 0)
            goto done;
        posted = on_cpu == hot->keep_cpu;
    }
    if (posted) {
        hot->keep_left -= 1;
    } else {
        PyObject *choice = NULL, *policy = self->policy, *why = Py_None;
        if (self->choose != Py_None) {
            PyObject *args[3] = {tensor, self->ctx, Py_None};
            choice = PyObject_Vectorcall(self->choose, args, 3, NULL);
            if (choice == NULL) {
                result = NULL;
                goto done;
            }
            if (!PyTuple_Check(choice) || PyTuple_GET_SIZE(choice) != 2) {
                Py_DECREF(choice);
                PyErr_SetString(PyExc_TypeError,
                                "tensorstash: a selector's choose must return (policy, reason); "
                                "this is a bug in tensorstash");
                result = NULL;
                goto done;
            }
            policy = PyTuple_GET_ITEM(choice, 0);
            why = PyTuple_GET_ITEM(choice, 1);
        }
        if ((PyObject *)Py_TYPE(policy) != self->keep_type) {
            /* pack_chosen(tensor, address, policy, why, record=None, wrapper=None) */
            PyObject *call[6] = {tensor, address, policy, why, Py_None, Py_None};
            result = PyObject_Vectorcall(self->pack_chosen, call, 6, NULL);
            Py_XDECREF(choice);
            hot->keep_left = 0; /* the tiers moved: the limit is stale */
            goto done;
        }
        Py_XDECREF(choice);
    }
    PyObject *prev = PyObject_GetAttr(self->order, s_last);
    if (prev == NULL) {
        result = NULL;
        goto done;
    }
    KeptObject *kept = kept_make(held, version, nbytes, hot, prev);
    Py_DECREF(prev);
    if (kept == NULL) {
        result = NULL;
        goto done;
    }
    Py_ssize_t tier_live = attr_ssize(self->kept_tier, s_live_bytes, 0);
    if (tier_live < 0 || dedupe_add(self, (PyObject *)kept, address) < 0) {
        Py_DECREF(kept); /* posts its bytes to released: counted below only on success */
        hot->released -= nbytes;
        result = NULL;
        goto done;
    }
    hot->tensors += 1;
    hot->bytes += nbytes;
    hot->live += nbytes;
    if (hot->live + tier_live > hot->peak)
        hot->peak = hot->live + tier_live;
    result = (PyObject *)kept;
done:
    if (result == Py_None && PyErr_Occurred())
        PyErr_Clear(); /* a failed read: the Python hook asks again, and reports */
    Py_XDECREF(held);
    Py_XDECREF(grad_fn);
    Py_XDECREF(address);
    Py_XDECREF(version);
    return result;
}

static PyObject *Hooks_pack(HooksObject *self, PyObject *tensor) {
    PyObject *result = pack_fast(self, tensor);
    if (result != Py_None)
        return result;
    self->hot->keep_left = 0; /* whatever the Python hook does, a posted limit is stale */
    return PyObject_CallOneArg(self->pack_slow, tensor);
}

static PyObject *Hooks_unpack(HooksObject *self, PyObject *saved) {
    PyObject *tensor, *expected;
    int kept = Py_IS_TYPE(saved, &KeptType);
    if (kept) {
        tensor = ((KeptObject *)saved)->tensor;
        expected = ((KeptObject *)saved)->version;
    } else if (PyTuple_CheckExact(saved) && PyTuple_GET_SIZE(saved) == 2) {
        tensor = PyTuple_GET_ITEM(saved, 0);
        expected = PyTuple_GET_ITEM(saved, 1);
    } else {
        return PyObject_CallOneArg(self->unpack_slow, saved);
    }
    int changed = changed_since(tensor, expected);
    if (changed < 0)
        return NULL;
    if (changed) /* rule 2: the Python hook raises as autograd would */
        return PyObject_CallOneArg(self->unpack_slow, saved);
    if (kept) {
        self->hot->unpacks += 1;
        PyObject *prev = ((KeptObject *)saved)->prev;
        if (prev != Py_None) { /* rule 6 */
            PyObject *done = PyObject_CallOneArg(self->prefetch, prev);
            if (done == NULL)
                return NULL;
            Py_DECREF(done);
        }
    }
    Py_INCREF(tensor);
    return tensor;
}

static PyMethodDef Hooks_methods[] = {
    {"pack", (PyCFunction)Hooks_pack, METH_O, "The pack hook to push."},
    {"unpack", (PyCFunction)Hooks_unpack, METH_O, "The unpack hook to push."},
    {NULL},
};

static PyMemberDef Hooks_members[] = {
    {"owner", T_OBJECT, offsetof(HooksObject, owner), READONLY, NULL},
    {NULL},
};

static PyTypeObject HooksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tensorstash.core._fast.Hooks",
    .tp_basicsize = sizeof(HooksObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A session's pack and unpack hooks, the kept path in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Hooks_init,
    .tp_dealloc = (destructor)Hooks_dealloc,
    .tp_traverse = (traverseproc)Hooks_traverse,
    .tp_clear = (inquiry)Hooks_clear,
    .tp_methods = Hooks_methods,
    .tp_members = Hooks_members,
};

/* -- module ---------------------------------------------------------------------------- */

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tensorstash.core._fast",
    .m_doc = "The session's kept path in C (NOTE [ Fast path ] in tensorstash/core/_fastpath.py).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__fast(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_nbytes, "nbytes"},         {&s_grad_fn, "grad_fn"},
        {&s_sequence_nr, "_sequence_nr"}, {&s_detach, "detach"},
        {&s_version, "_version"},      {&s_requires_grad, "requires_grad"},
        {&s_base, "_base"},            {&s_is_leaf, "is_leaf"},
        {&s_data_ptr, "data_ptr"},     {&s_reread, "reread"},
        {&s_stack, "stack"},           {&s_live_bytes, "live_bytes"},
        {&s_last, "last"},             {&s_sweep_at, "sweep_at"},
        {&s_sweep, "sweep"},           {&s_is_cpu, "is_cpu"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL)
            return NULL;
    }
    if (PyType_Ready(&HotType) < 0 || PyType_Ready(&KeptType) < 0 ||
        PyType_Ready(&HooksType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "HotCounts", (PyObject *)&HotType) < 0 ||
        PyModule_AddObjectRef(m, "Kept", (PyObject *)&KeptType) < 0 ||
        PyModule_AddObjectRef(m, "Hooks", (PyObject *)&HooksType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
