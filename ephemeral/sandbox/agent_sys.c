/* _ephemeral_agent: the guest agent's system calls that the standard library lacks (prctl,
 * capset) and RLIMIT_AS (resource's getrlimit and setrlimit), built into the agent runtime (agent_runtime.py) so that the agent
 * starts without ctypes and resource: under gVisor every module loaded at start is file opens
 * through the Gofer and page faults in the Sentry (ctypes alone was ~20 ms of a cold start).
 * The agent falls back to ctypes and resource where this module is absent (a microVM runs it on
 * the image's python). Limited API of the runtime's python version; no state, no allocation in
 * capset_clear (called in a forked child before exec). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

/* prctl(option, arg2): its result, OSError on failure */
static PyObject *agent_prctl(PyObject *self, PyObject *args) {
    int option;
    unsigned long arg2 = 0;
    if (!PyArg_ParseTuple(args, "i|k", &option, &arg2))
        return NULL;
    int r = prctl(option, arg2, 0UL, 0UL, 0UL);
    if (r < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(r);
}

/* capset(effective, permitted, inheritable) of this thread, the low 32 capabilities (the high
 * 32 cleared): None, OSError on failure */
static PyObject *agent_capset(PyObject *self, PyObject *args) {
    unsigned int eff, perm, inh;
    if (!PyArg_ParseTuple(args, "III", &eff, &perm, &inh))
        return NULL;
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2] = {{eff, perm, inh}, {0, 0, 0}};
    if (syscall(SYS_capset, &header, data) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* getrlimit(resource) as (soft, hard) and setrlimit(resource, (soft, hard)), as CPython's
 * resource module has them on Linux (RLIM_INFINITY is -1) */
static PyObject *agent_getrlimit(PyObject *self, PyObject *args) {
    int which;
    struct rlimit rl;
    if (!PyArg_ParseTuple(args, "i", &which))
        return NULL;
    if (getrlimit(which, &rl) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return Py_BuildValue("(LL)", (long long)rl.rlim_cur, (long long)rl.rlim_max);
}

static PyObject *agent_setrlimit(PyObject *self, PyObject *args) {
    int which;
    long long soft, hard;
    if (!PyArg_ParseTuple(args, "i(LL)", &which, &soft, &hard))
        return NULL;
    struct rlimit rl = {(rlim_t)soft, (rlim_t)hard};
    if (setrlimit(which, &rl) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"prctl", agent_prctl, METH_VARARGS, NULL},
    {"capset", agent_capset, METH_VARARGS, NULL},
    {"getrlimit", agent_getrlimit, METH_VARARGS, NULL},
    {"setrlimit", agent_setrlimit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ephemeral_agent", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ephemeral_agent(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "RLIMIT_AS", RLIMIT_AS) < 0 ||
        PyModule_AddIntConstant(m, "RLIM_INFINITY", -1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
