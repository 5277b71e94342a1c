from setuptools import setup, find_packages
import os, shlex, sys, time
from configparser import ConfigParser

assert setup is not None

# nbdev's setup.py, reading settings.ini; requirements are parsed without pkg_resources
config = ConfigParser(delimiters=['='])
config.read('settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

cfg_keys = 'version description keywords author author_email'.split()
expected = cfg_keys + "lib_name user branch license status min_python audience language".split()
for o in expected: assert o in cfg, "missing expected setting: {}".format(o)
setup_cfg = {o: cfg[o] for o in cfg_keys}

licenses = {
    'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License'),
    'mit': ('MIT License', 'OSI Approved :: MIT License'),
}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12 3.13'.split()

requirements = shlex.split(cfg.get('requirements', ''))
if cfg.get('pip_requirements'): requirements += shlex.split(cfg.get('pip_requirements', ''))
min_python = cfg['min_python']
lic = licenses.get(cfg['license'].lower(), (cfg['license'], None))
dev_requirements = (cfg.get('dev_requirements') or '').split()

package_data = dict()
pkg_data = cfg.get('package_data', None)
if pkg_data:
    package_data[pkg_data.split(':')[0].strip()] = pkg_data.split(':')[1].split()

# clfast's C++ CPU kernels are built on first use (or by `clfast build`), once per machine and torch, against the torch
# that runs them, saying so: an install needs neither torch nor a compiler, with or without pip's build isolation.
# A wheel for distribution builds them in: CLFAST_BUILD_KERNELS=all (every level) or host (this CPU's), with torch
# importable where it builds (`pip wheel --no-build-isolation .`); a library is named after the torch and sources it
# was built from, and a stale one is never loaded.
def _say(msg): print(f"clfast: {msg}", file=sys.stderr, flush=True)

def kernel_extensions():
    which = os.environ.get('CLFAST_BUILD_KERNELS', '').lower()
    if not which: return [], {}
    if which not in ('all', 'host'): raise SystemExit(f"CLFAST_BUILD_KERNELS must be 'all' or 'host', got {which!r}")
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from clfast import cpu_kernels
        from clfast.machine import CPU_LEVELS, host_isa
    except ImportError as e:
        raise SystemExit(f"CLFAST_BUILD_KERNELS={which} needs torch where the wheel builds ({e}): build with "
                         "`pip wheel --no-build-isolation .` in an environment that has the torch the wheel is for")
    why = cpu_kernels.missing_compiler()   # (ninja is not needed here: without it the build is serial)
    if why: raise SystemExit(f"CLFAST_BUILD_KERNELS={which}: cannot build the C++ CPU kernels: {why}")
    sources = [os.path.relpath(str(s)) for s in cpu_kernels.SOURCES]
    # -g0: Python's own flags add -g, a 10x larger library (40 MB a level) and a slower build
    exts = [CppExtension(f'clfast.{cpu_kernels.installed_name(level)}', sources,
                         extra_compile_args=cpu_kernels.build_flags(level) + ['-g0'], extra_link_args=['-fopenmp'])
            for level in (CPU_LEVELS if which == 'all' else [host_isa()])]
    return exts, {'build_ext': _build_kernels(cpu_kernels)}

def _build_kernels(cpu_kernels):
    from torch.utils.cpp_extension import BuildExtension
    class BuildKernels(BuildExtension):
        "Each level in its own build directory, timed"
        def build_extension(self, ext):
            level, base, t = ext.name.split('_kernels_')[1].split('_')[0], self.build_temp, time.time()
            self.build_temp = os.path.join(base, level)   # the levels compile the same sources with other flags
            _say(f"building the C++ CPU kernels at level {level} ...")
            try: super().build_extension(ext)
            finally: self.build_temp = base
            _say(f"built the C++ CPU kernels at level {level} in {time.time() - t:.0f} s")
    return BuildKernels

def check_wheel_tools():
    """pip without build isolation builds with this environment's setuptools; making a wheel (an install, editable or
    not) needs setuptools>=70.1 or the `wheel` package, which a new venv's setuptools (65 on Python 3.11) lacks"""
    if not {'dist_info', 'bdist_wheel', 'editable_wheel'} & set(sys.argv): return
    try: import setuptools.command.bdist_wheel   # noqa: F401  (setuptools>=70.1)
    except ImportError:
        try: import wheel   # noqa: F401
        except ImportError:
            raise SystemExit("clfast: this environment's setuptools cannot build a wheel (no `wheel` package, setuptools "
                             "older than 70.1), which pip needs with --no-build-isolation: run `pip install -U setuptools "
                             "wheel` first, or install without --no-build-isolation (clfast's build needs no torch)")

check_wheel_tools()
ext_modules, cmdclass = kernel_extensions()

setup(
    name=cfg['lib_name'],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    license=lic[0],
    classifiers=[
        'Development Status :: ' + statuses[int(cfg['status'])],
        'Intended Audience :: ' + cfg['audience'].title(),
        'Natural Language :: ' + cfg['language'].title(),
    ] + ['Programming Language :: Python :: ' + o for o in py_versions[py_versions.index(min_python):]]
      + (['License :: ' + lic[1]] if lic[1] else []),
    url=cfg['git_url'],
    packages=find_packages(include=[cfg['lib_path'], cfg['lib_path'] + '.*']),
    include_package_data=True,
    package_data=package_data,
    install_requires=requirements,
    extras_require={'dev': dev_requirements},
    dependency_links=cfg.get('dep_links', '').split(),
    python_requires='>=' + cfg['min_python'],
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={
        'console_scripts': cfg.get('console_scripts', '').split(),
        'nbdev': [f'{cfg.get("lib_path")}={cfg.get("lib_path")}._modidx:d'],
    },
    **setup_cfg)
