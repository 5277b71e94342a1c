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

# clfast's C++ CPU kernels, built here for every instruction-set level this CPU runs (clfast/cpu_kernels.py). They
# need torch at build time: `pip install --no-build-isolation` (pip's isolated build environment has no torch). Without
# torch or a compiler the install goes on without them, and the kernels build at first use (or with `clfast build`).
def _say(msg): print(f"clfast: {msg}", file=sys.stderr, flush=True)

def kernel_extensions():
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from clfast import cpu_kernels
    except ImportError as e:
        _say(f"WARNING: not building the C++ CPU kernels now ({e}): install with `pip install --no-build-isolation`, "
             "or they build at the first fused call (or run `clfast build`)")
        return [], {}
    why = cpu_kernels.missing_compiler()   # (ninja is not needed here: without it the build is serial)
    if why:
        _say(f"WARNING: not building the C++ CPU kernels: {why}. clfast works without them: fused layers run as their "
             "stock modules until they can be built (`clfast build`)")
        return [], {}
    sources = [os.path.relpath(str(s)) for s in cpu_kernels.SOURCES]
    # a library's name says what it was built from (level, torch, sources and flags): a stale one is never loaded
    # -g0: Python's own flags add -g, a 10x larger library (40 MB a level) and a slower build
    exts = [CppExtension(f'clfast.{cpu_kernels.installed_name(level)}', sources,
                         extra_compile_args=cpu_kernels.build_flags(level) + ['-g0'], extra_link_args=['-fopenmp'])
            for level in cpu_kernels.install_levels()]
    return exts, {'build_ext': _build_kernels(cpu_kernels)}

def _build_kernels(cpu_kernels):
    from torch.utils.cpp_extension import BuildExtension
    class BuildKernels(BuildExtension):
        "Each level in its own build directory, timed; a failure warns and the install goes on"
        def build_extension(self, ext):
            level, base, t = ext.name.split('_kernels_')[1].split('_')[0], self.build_temp, time.time()
            self.build_temp = os.path.join(base, level)   # the levels compile the same sources with other flags
            _say(f"building the C++ CPU kernels at level {level} ...")
            try: super().build_extension(ext)
            except Exception as e:
                _say(f"WARNING: the C++ CPU kernels did not build at level {level} ({e}); they build at first use")
                return
            finally: self.build_temp = base
            _say(f"built the C++ CPU kernels at level {level} in {time.time() - t:.0f} s")
    return BuildKernels

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
